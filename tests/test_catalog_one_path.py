"""One path for every KV figure: a metric added to the catalog, and nothing else, is exported by
both exporters, read by the scrape layer and combined across engines by its own rule.

No engine: the exporters are fed KVStats as the scheduler feeds them, the scrape layer reads what
the Prometheus exporter wrote, and the OTLP export goes to a real receiver.
"""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxima.exposition import MalformedMetrics
from proxima.kv_snapshot import KVSnapshot
from proxima.metrics import catalog as c
from proxima.metrics.kv_stats import KVStats
from proxima.metrics.otel import OtelKVExporter
from proxima.metrics.prometheus import PrometheusKVExporter
from proxima.scrape import kv_capacity_tokens, parse_metrics
from tests.otlp_receiver import OtlpReceiver

ROOT = Path(__file__).resolve().parents[1]

# A gauge the engine already computes but does not export: what adding one takes is this entry.
FAKE = c.MetricSpec(
    "proxima_kv_reference_block_slots", c.Kind.GAUGE,
    "Slots 16-token blocks would take for the live requests (test-only entry).", unit="slots",
    figure="reference_block_slots", stat="reference_block_slots",
)

STATS = (
    KVStats(allocator="token", granularity=1, slots_total=1000, slots_used=300, slots_cached=40,
            live_tokens=290, requests_holding_slots=3, reference_block=16, reference_block_slots=320,
            occupancy=(1.0, 0.2), largest_free_run=600, occupancy_cached=(0.0, 0.04)),
    KVStats(allocator="token", granularity=1, slots_total=3000, slots_used=150, slots_cached=0,
            live_tokens=100, requests_holding_slots=2, reference_block=16, reference_block_slots=128,
            occupancy=(0.0, 0.1), largest_free_run=2800, occupancy_cached=(0.0, 0.0)),
)


@pytest.fixture
def fake_metric(monkeypatch):
    monkeypatch.setattr(c, "ENGINE_METRICS", (*c.ENGINE_METRICS, FAKE))
    return FAKE


def _exposition(stats: tuple[KVStats, ...]) -> str:
    """Each engine's exporter in its own registry, exposed together as one server's /metrics: each
    family once with every engine's series (as vLLM's multiprocess collector serves them), beside
    a vLLM series (a page without one is no vLLM server's)."""
    families: dict[str, list[str]] = {}
    for engine, s in enumerate(stats):
        exporter = PrometheusKVExporter(CollectorRegistry(), engine=str(engine))
        exporter.set_static(s.allocator, s.granularity, 1024, s.slots_total * 1024)
        exporter.publish(s)
        family = None
        for line in generate_latest(exporter.registry).decode().splitlines():
            if line.startswith("# HELP "):
                family = line.split(" ")[2]
                lines = families.setdefault(family, [])
                if lines:
                    continue  # declared by the first engine already
            elif line.startswith("# TYPE ") and len(families[family]) > 1:
                continue
            families[family].append(line)
    return "".join(line + "\n" for lines in families.values() for line in lines) + VLLM_LINE


VLLM_LINE = 'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n'


def test_a_catalog_entry_is_exported_to_prometheus(fake_metric):
    registry = CollectorRegistry()
    exporter = PrometheusKVExporter(registry, engine="0")
    exporter.publish(STATS[0])
    assert registry.get_sample_value(fake_metric.name, {"engine": "0"}) == 320
    exporter.publish(replace(STATS[0], reference_block_slots=336))
    assert registry.get_sample_value(fake_metric.name, {"engine": "0"}) == 336


def test_a_catalog_entry_is_exported_over_otlp(fake_metric):
    with OtlpReceiver() as receiver:
        exporter = OtelKVExporter(receiver.url, engine="0", export_interval_ms=3_600_000)
        exporter.set_static("token", 1, 1024, 1 << 20)
        exporter.publish(STATS[0])
        exporter.meter_provider.force_flush()
        exporter.shutdown()
        points = receiver.gauge_points(fake_metric.name)
    assert points and points[-1].as_int == 320
    assert {a.key: a.value.string_value for a in points[-1].attributes} == {"engine": "0"}


def test_a_catalog_entry_is_scraped_and_combined_across_engines(fake_metric, monkeypatch):
    text = _exposition(STATS)
    parts = [parse_metrics(text, engine=e).proxima for e in ("0", "1")]
    assert [p.figure(fake_metric.figure) for p in parts] == [320, 128]
    assert parts[0].other == {fake_metric.figure: 320}  # no field of its own: kept by name
    kv = parse_metrics(text).proxima
    assert kv is not None and kv.engines == ("0", "1")
    assert kv.figure(fake_metric.figure) == 320 + 128  # its rule: Combine.SUM
    # The same entry marked as a maximum combines as one, with nothing else changed.
    assert fake_metric.combine is c.Combine.SUM
    as_max = replace(fake_metric, combine=c.Combine.MAX)
    monkeypatch.setattr(c, "ENGINE_METRICS", (*c.ENGINE_METRICS[:-1], as_max))
    assert KVSnapshot.combine(parts).figure(fake_metric.figure) == 320


def test_the_existing_figures_combine_by_their_rules():
    text = _exposition(STATS)
    parts = [parse_metrics(text, engine=e).proxima for e in ("0", "1")]
    kv = parse_metrics(text).proxima
    assert kv == KVSnapshot.combine(parts)
    assert (kv.slots_total, kv.slots_used, kv.live_tokens, kv.slots_cached) == (4000, 450, 390, 40)
    assert kv.token_usage == pytest.approx(390 / 4000)  # RATIO of summed counts, never 0.29 + 0.03
    assert kv.fragmentation == pytest.approx((450 - 390) / 450)
    assert kv.block_usage == pytest.approx((320 + 128) / 4000)
    assert kv.block_fragmentation == pytest.approx((448 - 390) / 448)
    # Slot-weighted, segment by segment (the exporter shows all 64, unpublished ones at 0).
    assert kv.occupancy[:2] == pytest.approx(((1.0 * 1000 + 0.0) / 4000, (0.2 * 1000 + 0.1 * 3000) / 4000))
    assert kv.occupancy_cached[:2] == pytest.approx((0.0, 0.04 * 1000 / 4000))
    assert kv.largest_free_run == 2800 and kv.bytes_per_token == 1024  # MAX
    assert kv.cache_bytes == 4000 * 1024 and kv.requests_holding_slots == 5  # SUM
    assert (kv.allocator, kv.granularity) == ("token", 1)
    assert KVSnapshot.combine([parts[0]]) is parts[0] and KVSnapshot.combine([]) is None


def test_tops_all_servers_view_combines_servers_as_the_scrape_combines_engines():
    from proxima.tui.model import Frame
    from proxima.tui.state import DashboardState

    servers = tuple(parse_metrics(_exposition((s,)), url=f"http://h{i}:8000", taken_at=1.0)
                    for i, s in enumerate(STATS))
    state = DashboardState.empty(tuple(s.url for s in servers)).advance(Frame(1.0, servers, None))
    assert state.aggregate.kv == KVSnapshot.combine([s.proxima for s in servers])
    assert state.aggregate.kv.occupancy  # the slot-weighted map is kept, as for engines
    assert state.aggregate.capacity_tokens == 4000


def test_every_catalog_entry_names_its_path_consistently():
    fields = set(KVSnapshot.__dataclass_fields__)
    for spec in c.ENGINE_METRICS:
        assert spec.figure in fields, spec.name  # every shipped figure has its typed field
        assert (spec.read is c.Read.COMPUTED) <= (spec.combine in (c.Combine.RATIO, c.Combine.WASTE))
        for term in spec.of:
            assert all(name in fields for name in term.split("*")), (spec.name, term)
        if spec.stat is not None:
            value = STATS[0]
            for part in spec.stat.split("."):
                value = getattr(value, part)  # the engine publishes it: KVStats has it
    ratios = [s for s in c.ENGINE_METRICS if s.name.endswith("_ratio")]
    assert ratios and all(s.combine is not c.Combine.SUM for s in ratios)  # a ratio is never added


def test_kv_capacity_is_one_rule_for_every_server():
    text = _exposition(STATS[:1])
    assert kv_capacity_tokens(parse_metrics(text)) == 1000  # Proxima: its slots
    stock = ('# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{block_size="16",engine="0",'
             'num_gpu_blocks="%s",kv_cache_size_tokens="4000"} 1.0\n')
    assert kv_capacity_tokens(parse_metrics(stock % "256")) == 256 * 16  # stock: blocks x size
    assert kv_capacity_tokens(parse_metrics(stock % "None")) == 4000  # else vLLM's token count
    assert kv_capacity_tokens(parse_metrics(VLLM_LINE)) is None
    with pytest.raises(MalformedMetrics, match="no vLLM metrics"):
        parse_metrics("")  # an empty page is no server's, not an idle one's


def test_metrics_package_imports_nothing_from_the_engine():
    for path in (ROOT / "proxima" / "metrics").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else [f"..{node.module or ''}"]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                assert not name.startswith(("proxima.engine", "..engine")), f"{path.name} imports {name}"
