"""The generated Grafana dashboards: committed JSON is current, names come from the catalog,
Proxima-only panels say so, variables and panels the dashboards promise are there.

`dashboards/` is a build tool at the repository root, not an installed package: the tests put
the root on sys.path (as `python -m dashboards.generate` run from the root does).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

pytest.importorskip("grafana_foundation_sdk", reason="pip install grafana-foundation-sdk (test extra)")

from dashboards import generate, panels, promql  # noqa: E402 (after the sys.path set-up above)
from proxima.metrics import catalog as c  # noqa: E402

GRAFANA = ROOT / "dashboards" / "grafana"
DASHBOARD_FILES = ("proxima-kv-memory.json", "proxima-serving.json", "proxima-ab.json")
VLLM_NAMES = frozenset(v for k, v in vars(c.Vllm).items() if not k.startswith("_"))
METRIC_TOKEN = re.compile(r"\b(proxima_\w+|vllm:[\w:]+)")
# Grafana variables start with a letter or `_`; `$1` in label_replace is Prometheus' own.
VARIABLE = re.compile(r"\$\{?([A-Za-z_]\w*)\}?")


def load(name: str) -> dict:
    return panels.load(GRAFANA / name)


def targets(name: str) -> list[tuple[dict, dict]]:
    return panels.panel_targets(load(name))


def test_committed_outputs_match_a_fresh_generation(tmp_path):
    assert generate.main(["--out", str(tmp_path)]) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(generate.outputs())
    for rel in written:
        fresh = (tmp_path / rel).read_bytes()
        committed = (ROOT / "dashboards" / rel).read_bytes()
        assert fresh == committed, f"dashboards/{rel} is stale: run `python -m dashboards.generate`"


def test_generation_is_deterministic_within_one_process():
    assert generate.outputs() == generate.outputs()


def test_check_mode_names_a_stale_file(tmp_path, capsys):
    assert generate.main(["--out", str(tmp_path)]) == 0
    assert generate.main(["--out", str(tmp_path), "--check"]) == 0
    stale = tmp_path / "grafana" / "proxima-ab.json"
    stale.write_text(stale.read_text().replace("Proxima", "Proximo", 1))
    assert generate.main(["--out", str(tmp_path), "--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "proxima-ab.json" in err[0] and "dashboards.generate" in err[0]


def test_bad_runbook_base_is_one_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        generate.main(["--out", str(tmp_path), "--runbook-base", "https://example.org/runbooks"])
    assert exit_info.value.code == 2
    assert "--runbook-base must end with '/'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()), "nothing is written on a usage error"


def test_no_metric_name_is_spelled_in_the_generator():
    names = promql.PROXIMA_NAMES | VLLM_NAMES
    for module in sorted((ROOT / "dashboards").glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                spelled = [n for n in names if promql.mentions(node.value, n)]
                assert not spelled, f"{module.name}:{node.lineno} spells {spelled}; use the catalog"


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_every_queried_metric_is_in_the_catalog(name):
    known = promql.PROXIMA_NAMES | VLLM_NAMES
    for panel, target in targets(name):
        for token in METRIC_TOKEN.findall(target["expr"]):
            base = re.sub(r"_(bucket|count|sum)$", "", token)
            assert token in known or base in known, f"{panel['title']}: unknown metric {token}"


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_panels_reading_proxima_metrics_say_so(name):
    dashboard = load(name)
    checked = 0
    for panel in dashboard["panels"]:
        if not panel.get("targets"):
            continue
        flags = [promql.needs_proxima(t["expr"]) for t in panel["targets"]]
        description = panel.get("description", "")
        if all(flags):
            assert panels.NEEDS_PROXIMA in description, panel["title"]
        elif any(flags):
            assert panels.PARTLY_PROXIMA in description, panel["title"]
        else:
            assert "proxima_*" not in description, f"{panel['title']} reads no proxima_* metric"
        checked += 1
    assert checked >= 8


@pytest.mark.parametrize("name", DASHBOARD_FILES)
def test_structure_ids_datasource_and_variables(name):
    dashboard = load(name)
    ids = [p["id"] for p in dashboard["panels"]]
    assert ids == list(range(1, len(ids) + 1)), "ids are stable: 1..n in layout order"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert "model_name" in variables
    assert {"instance"} <= variables.keys() or {"instance_a", "instance_b"} <= variables.keys()
    for panel, target in targets(name):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        used = set(VARIABLE.findall(target["expr"]))
        assert used - {"__rate_interval"} <= variables.keys(), (panel["title"], used)
        assert target["refId"] and target["legendFormat"], panel["title"]


def test_dashboard_uids_are_unique_and_linked():
    uids = [load(name)["uid"] for name in DASHBOARD_FILES]
    assert len(set(uids)) == len(uids)
    for name in DASHBOARD_FILES:
        links = load(name)["links"]
        assert links and links[0]["tags"] == ["proxima"]


def _exprs(name: str, title_part: str) -> list[str]:
    found = [t["expr"] for p, t in targets(name) if title_part.lower() in p["title"].lower()]
    assert found, f"{name} has no panel titled like {title_part!r}"
    return found


def test_kv_memory_dashboard_has_the_promised_panels():
    name = "proxima-kv-memory.json"
    occupancy = [p for p in load(name)["panels"] if p["type"] == "state-timeline"]
    assert len(occupancy) == 1 and occupancy[0]["repeat"] == "instance"
    assert c.OCCUPANCY_MAP.name in occupancy[0]["targets"][0]["expr"]
    usage = " ".join(_exprs(name, "token vs block usage"))
    assert all(n in usage for n in (c.TOKEN_USAGE.name, c.BLOCK_USAGE.name, c.Vllm.KV_USAGE))
    frag = " ".join(_exprs(name, "fragmentation"))
    assert c.FRAGMENTATION.name in frag and c.BLOCK_FRAGMENTATION.name in frag
    latency = _exprs(name, "allocator latency")
    assert [e.split(",")[0] for e in latency] == ["histogram_quantile(0.5", "histogram_quantile(0.99"]
    assert all("by (instance, op, le)" in e and "_bucket" in e and "rate(" in e for e in latency)
    assert c.PREEMPTIONS.sample_name in " ".join(_exprs(name, "preemptions"))
    headroom = " ".join(_exprs(name, "free"))
    assert c.SLOTS_FREE.name in headroom and c.LARGEST_FREE_RUN.name in headroom


def test_serving_dashboard_has_the_promised_panels():
    name = "proxima-serving.json"
    assert f"rate({c.Vllm.REQUEST_SUCCESS}" in " ".join(_exprs(name, "requests / s"))
    tokens = " ".join(_exprs(name, "tokens / s"))
    assert c.Vllm.PROMPT_TOKENS in tokens and c.Vllm.GENERATION_TOKENS in tokens
    for title, histogram in (("time to first token", c.Vllm.TTFT), ("inter-token", c.Vllm.ITL),
                             ("end-to-end", c.Vllm.E2E)):
        exprs = _exprs(name, title)
        assert [e.split(",")[0] for e in exprs] == [
            "histogram_quantile(0.5", "histogram_quantile(0.95", "histogram_quantile(0.99"]
        assert all(f"{histogram}_bucket" in e for e in exprs)
    queue = " ".join(_exprs(name, "running / waiting"))
    assert c.Vllm.RUNNING in queue and c.Vllm.WAITING in queue
    assert not any(promql.needs_proxima(t["expr"]) for _, t in targets(name)), "works on stock"


def test_ab_dashboard_compares_both_instances_everywhere():
    name = "proxima-ab.json"
    for title in ("kv usage", "fragmentation", "generation tokens / s", "p95", "preemptions"):
        joined = " ".join(_exprs(name, title))
        assert '"$instance_a"' in joined and '"$instance_b"' in joined, title
    for panel, target in targets(name):
        assert "$instance_a" in target["expr"] or "$instance_b" in target["expr"], panel["title"]
        assert "$instance\"" not in target["expr"] and "$instance}" not in target["expr"]
    assert "no-throughput-gain.md" in json.dumps(load(name))


def test_runbook_base_default_is_shared_with_the_rules():
    from dashboards import alerts

    assert generate.DEFAULT_RUNBOOK_BASE == alerts.DEFAULT_RUNBOOK_BASE


def test_missing_sdk_is_one_line_naming_the_install(tmp_path, monkeypatch, capsys):
    # Uninstalling the SDK inside a test run is not an option; hide it from the lookup instead.
    real = generate.importlib.util.find_spec
    monkeypatch.setattr(generate.importlib.util, "find_spec",
                        lambda name: None if name == "grafana_foundation_sdk" else real(name))
    assert generate.main(["--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install 'grafana-foundation-sdk==" in err[0]
    assert not any(tmp_path.iterdir())
