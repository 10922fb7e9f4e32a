"""Runbooks: every path a probe names exists, every relative link resolves, every page has the
required parts, and every metric name in their PromQL is one the catalog defines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
