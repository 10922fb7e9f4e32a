"""The generated alert rules: valid for promtool, unit-tested by promtool (every alert fires on
its scenario and stays silent on the near misses), and the unit tests catch a loosened rule.

promtool comes with Debian's `prometheus` package (scripts/prometheus.sh installs it; CI runs
that script). Without it the promtool tests skip, saying so.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dashboards import alert_tests, alerts  # noqa: E402 (after the sys.path set-up above)
from proxima.metrics import catalog as c  # noqa: E402

PROM_DIR = ROOT / "dashboards" / "prometheus"
RULES = PROM_DIR / "proxima-alerts.yml"
RULE_TESTS = PROM_DIR / "proxima-alerts.test.yml"
SCRAPE_EXAMPLE = PROM_DIR / "scrape-example.yml"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed: run scripts/prometheus.sh (CI does)")


def promtool(*args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          check=False)


def rules_file() -> dict:
    return yaml.safe_load(RULES.read_text(encoding="utf-8"))


def test_rules_file_matches_the_rule_definitions():
    loaded = {r["alert"]: r for r in rules_file()["groups"][0]["rules"]}
    assert list(loaded) == [r.name for r in alerts.RULES]
    for rule in alerts.RULES:
        assert loaded[rule.name]["expr"].strip() == rule.expr
        for signal in rule.signals:
            assert signal in rule.expr


def test_every_rule_has_severity_summary_description_and_runbook():
    for rule in rules_file()["groups"][0]["rules"]:
        assert rule["for"] and rule["labels"]["severity"] in {"critical", "warning", "info"}
        notes = rule["annotations"]
        assert len(notes["summary"]) > 20 and len(notes["description"]) > 80, rule["alert"]
        page = notes["runbook_url"].removeprefix("runbooks/").removesuffix(".md")
        assert notes["runbook_url"] == f"runbooks/{page}.md"
        assert notes["runbook_command"] == f"proxima runbook {page}"


def test_rules_cover_the_promised_failure_modes():
    exprs = {r.name: r.expr for r in alerts.RULES}
    assert f"{c.TOKEN_USAGE.name} > 0.95" in exprs["ProximaKVExhaustionImminent"]
    assert f"{c.Vllm.WAITING} > 0" in exprs["ProximaKVExhaustionImminent"]
    assert f"rate({c.Vllm.PREEMPTIONS}[5m]) > 0" == exprs["ProximaSustainedPreemptions"]
    leak = exprs["ProximaSlotLeak"]
    assert all(s in leak for s in (f"{c.SLOTS_USED.name} > 0", f"{c.Vllm.RUNNING} == 0",
                                   f"{c.Vllm.WAITING} == 0"))
    assert "deriv(" in exprs["ProximaKVMemoryGrowth"]
    assert 'op="step"' in exprs["ProximaAllocatorStepLatencyHigh"]
    assert exprs["ProximaAllocatorStepLatencyHigh"].endswith(f"> {c.ALLOCATOR_STEP_P99_LIMIT_S:g}")
    assert "offset 1d" in exprs["ProximaAllocatorStepLatencyRegression"]
    durations = {r.name: r.for_ for r in alerts.RULES}
    assert durations["ProximaKVExhaustionImminent"] == "2m"
    assert durations["ProximaSustainedPreemptions"] == durations["ProximaSlotLeak"] == "5m"
    assert durations["ProximaAllocatorStepLatencyHigh"] == "10m"


def test_unknown_runbook_page_is_refused():
    with pytest.raises(ValueError, match="no runbook 'oom'; runbooks: allocator-latency"):
        alerts.runbook_url("oom")


def test_every_alert_has_a_firing_and_a_silent_case():
    tests = yaml.safe_load(RULE_TESTS.read_text(encoding="utf-8"))["tests"]
    covered = set()
    for group in tests:
        instances = {s["series"].split('instance="')[1].split('"')[0] for s in group["input_series"]}
        for check in group["alert_rule_test"]:
            fired = {a["exp_labels"]["instance"] for a in check["exp_alerts"]}
            if fired:
                assert instances - fired, f"{check['alertname']}: no target stays silent"
                covered.add(check["alertname"])
        assert any(not ch["exp_alerts"] for ch in group["alert_rule_test"]), group["name"]
    assert covered == {r.name for r in alerts.RULES}


@needs_promtool
def test_promtool_accepts_the_rules():
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts.RULES)} rules found" in result.stdout


@needs_promtool
def test_promtool_unit_tests_pass():
    result = promtool("test", "rules", RULE_TESTS.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
@pytest.mark.parametrize("rule", alerts.RULES, ids=lambda r: r.name)
def test_unit_tests_catch_a_rule_without_its_thresholds(rule, tmp_path):
    """Each rule reduced to its bare signals fires on the near misses: promtool must fail."""
    loosened = rules_file()
    for entry in loosened["groups"][0]["rules"]:
        if entry["alert"] == rule.name:
            entry["expr"] = f"\nand on({', '.join(alerts.JOIN_ON)})\n".join(rule.signals)
    (tmp_path / alert_tests.RULES_FILE).write_text(alerts.dump_yaml(loosened), encoding="utf-8")
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0
    assert f"alertname: {rule.name}" in result.stdout + result.stderr


@needs_promtool
def test_scrape_example_is_a_valid_config_that_loads_the_rules():
    result = promtool("check", "config", SCRAPE_EXAMPLE.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_doctor_and_the_alert_judge_step_latency_by_one_catalog_value():
    from proxima.probes import allocator
    from proxima.probes.base import Status
    from proxima.scrape import KVSnapshot

    limit = c.ALLOCATOR_STEP_P99_LIMIT_S
    assert limit in c.ALLOCATOR_LATENCY.buckets  # a p99 from the buckets crosses it exactly
    (high,) = (r for r in alerts.RULES if r.name == "ProximaAllocatorStepLatencyHigh")
    assert high.conditions[0].threshold == f"{limit:g}" and f"above {limit * 1e3:g} ms" in high.description
    kv = KVSnapshot("token", 1, 100, 60, 40, 0, 50, 0.5, 0.6, 0.1, 0.2, (), 10, 1024, 1 << 20, 3, 0)
    for step_p99, status in ((limit * 0.99, Status.OK), (limit * 1.01, Status.WARN)):
        readings = allocator.Readings(kv, step_p99, 0.01, {})  # a small share: only the p99 decides
        assert allocator.judge(readings).status is status, (step_p99, limit)
