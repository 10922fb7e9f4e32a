"""Runbooks: every page a probe or an alert names ships in the installed package, every relative
link resolves, every page has the required parts, and every metric name in their PromQL is one the
catalog defines."""

from __future__ import annotations

import re
import tomllib
from importlib.resources import files
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from proxima import runbooks
from proxima.cli.doctor import runbook_line
from proxima.cli.main import app
from proxima.metrics import catalog as c

ROOT = Path(__file__).resolve().parents[1]
RUNBOOKS = ROOT / "runbooks"
PROBES = ROOT / "probes"
PAGES = sorted(p for p in RUNBOOKS.glob("*.md") if p.name != "README.md")
REQUIRED_PAGES = {
    "startup-failure.md", "oom-under-load.md", "memory-leak.md", "nondeterministic-output.md",
    "no-throughput-gain.md", "rollback-to-stock.md", "kv-exhaustion.md", "allocator-latency.md",
}
RUNBOOK_REF = re.compile(r"runbooks/[A-Za-z0-9_.-]+\.md")
RUNBOOK_COMMAND = re.compile(r"proxima runbook ([A-Za-z0-9_-]+)")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
PROMQL_BLOCK = re.compile(r"```promql\n(.*?)```", re.DOTALL)
METRIC_TOKEN = re.compile(r"\b(?:proxima_[a-z0-9_]+|vllm:[a-z0-9_:]+)")


def _known_metric_names() -> set[str]:
    names: set[str] = set()
    for spec in c.ENGINE_METRICS:
        names.add(spec.sample_name)
        if spec.kind is c.Kind.HISTOGRAM:
            names.update(spec.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    for attr, value in vars(c.Vllm).items():
        if attr.isupper() and isinstance(value, str):
            names.add(value)
            names.update(value + suffix for suffix in ("_bucket", "_sum", "_count"))
    return names


def test_every_required_page_exists_and_is_indexed():
    present = {p.name for p in PAGES}
    assert REQUIRED_PAGES <= present, f"missing runbooks: {sorted(REQUIRED_PAGES - present)}"
    index = (RUNBOOKS / "README.md").read_text()
    for name in present:
        assert f"]({name})" in index, f"runbooks/README.md does not link {name}"


def test_every_runbook_path_named_by_a_probe_exists():
    found = {}
    for source in sorted(PROBES.glob("*.py")):
        for ref in RUNBOOK_REF.findall(source.read_text()):
            found.setdefault(ref, source.name)
    assert len(found) >= 6, f"probes name too few runbooks: {found}"
    missing = {ref: where for ref, where in found.items() if not (ROOT / ref).is_file()}
    assert not missing, f"probes link runbooks that do not exist: {missing}"


def _doctor_and_alert_references() -> dict[str, str]:
    """Every runbook page the doctor (its probes, its renderer) and the alert rules and dashboards
    name, whether as a path or as a `proxima runbook NAME` command -> where it was named."""
    sources = [*sorted(PROBES.glob("*.py")), ROOT / "proxima" / "cli" / "doctor.py",
               ROOT / "dashboards" / "prometheus" / "proxima-alerts.yml",
               *sorted((ROOT / "dashboards" / "grafana").glob("*.json"))]
    found: dict[str, str] = {}
    for source in sources:
        text = source.read_text()
        for ref in RUNBOOK_REF.findall(text) + RUNBOOK_COMMAND.findall(text):
            found.setdefault(runbooks.page_name(ref), source.name)
    return found


def test_every_runbook_doctor_and_the_alerts_name_ships_in_the_package():
    found = _doctor_and_alert_references()
    assert {"allocator-latency", "rollback-to-stock", "prefix-cache-thrash"} <= set(found), found
    installed = files("proxima.runbooks")  # where `pip install` puts them, not the checkout
    missing = {name: where for name, where in found.items() if not (installed / f"{name}.md").is_file()}
    assert not missing, f"named runbooks the package does not ship: {missing}"


def test_every_alert_carries_a_link_and_a_command_that_resolve():
    rules = yaml.safe_load((ROOT / "dashboards" / "prometheus" / "proxima-alerts.yml").read_text())
    for rule in rules["groups"][0]["rules"]:
        notes = rule["annotations"]
        name = runbooks.page_name(notes["runbook_url"])
        assert notes["runbook_command"] == f"proxima runbook {name}", rule["alert"]
        assert runbooks.page(name).is_file()


def test_doctor_prints_the_installed_file_and_the_command():
    line = runbook_line("runbooks/memory-leak.md")
    command, _, path = line.partition("  (")
    assert command == "proxima runbook memory-leak"
    assert Path(path.removesuffix(")")).read_text() == (RUNBOOKS / "memory-leak.md").read_text()
    assert runbook_line("runbooks/gone.md") == "runbooks/gone.md"  # a JSON report from another install


def test_runbook_command_prints_lists_and_refuses():
    cli = CliRunner()
    shown = cli.invoke(app, ["runbook", "oom-under-load"])
    assert shown.exit_code == 0 and shown.output == (RUNBOOKS / "oom-under-load.md").read_text()
    path = cli.invoke(app, ["runbook", "runbooks/oom-under-load.md", "--path"])
    assert Path(path.output.strip()).read_text() == shown.output
    listed = cli.invoke(app, ["runbook"])
    assert [line.split()[0] for line in listed.output.splitlines()] == [p.stem for p in PAGES]
    wrong = cli.invoke(app, ["runbook", "oom"])
    assert wrong.exit_code == 2 and "no runbook 'oom'; runbooks: allocator-latency" in wrong.output


def test_pyproject_ships_the_pages_as_package_data():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"]["proxima.runbooks"] == "runbooks"
    assert "proxima.runbooks" in setuptools["packages"]
    assert setuptools["package-data"]["proxima.runbooks"] == ["*.md"]


@pytest.mark.parametrize("page", [RUNBOOKS / "README.md", *PAGES], ids=lambda p: p.name)
def test_relative_links_resolve(page: Path):
    for target in MD_LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        assert (page.parent / target).resolve().exists(), f"{page.name} links {target}, which does not exist"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_has_the_required_parts(page: Path):
    text = page.read_text()
    headings = [h.lower() for h in re.findall(r"^## (.+)$", text, re.MULTILINE)]
    assert any(h.startswith("symptoms") for h in headings), f"{page.name}: no Symptoms section"
    assert any(h.startswith("confirm") for h in headings), f"{page.name}: no Confirm section"
    assert any(h.startswith("verify") for h in headings), f"{page.name}: no Verify section"
    if page.name != "rollback-to-stock.md":  # a procedure, not a diagnosis: options instead of causes
        assert any(h.startswith("causes") for h in headings), f"{page.name}: no Causes section"
        assert any(h.startswith("fixes") for h in headings), f"{page.name}: no Fixes section"
    assert "proxima doctor" in text, f"{page.name} does not say which doctor check confirms it"
    assert PROMQL_BLOCK.search(text), f"{page.name} has no PromQL"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_promql_uses_catalog_names(page: Path):
    known = _known_metric_names()
    for block in PROMQL_BLOCK.findall(page.read_text()):
        for name in METRIC_TOKEN.findall(block):
            assert name in known, f"{page.name}: PromQL names {name!r}, which the catalog does not define"
