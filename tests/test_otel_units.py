"""The OTLP exporter without an engine: batched latency histograms equal the SDK's own
histogram fed value by value, reach a real OTLP/HTTP receiver, and the export is announced."""

from __future__ import annotations

import logging

from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View

from proxima.metrics import catalog as c
from proxima.metrics.otel import OtelKVExporter
from proxima.metrics.otel_env import otlp_endpoint_from_env
from proxima.metrics.otel_latency import LatencyHistograms
from tests.otlp_receiver import OtlpReceiver
from tests.test_telemetry_fail_open import STATS

BOUNDS = list(c.ALLOCATOR_LATENCY.buckets)
EDGES = [b for bound in BOUNDS for b in (bound, bound * 0.999, bound * 1.001)]
VALUES = st.one_of(st.sampled_from(EDGES + [0.0]), st.floats(0, 10, allow_nan=False))


def _sdk_point(batches: list[list[float]]):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader], views=[View(
        instrument_name="h", aggregation=ExplicitBucketHistogramAggregation(BOUNDS))])
    histogram = provider.get_meter("t").create_histogram("h")
    for batch in batches:
        for value in batch:
            histogram.record(value, {"engine": "0", "op": "allocate"})
    data = reader.get_metrics_data()
    (point,) = data.resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    provider.shutdown()
    return point


@settings(max_examples=100)
@given(st.lists(st.lists(VALUES, min_size=1, max_size=80), min_size=1, max_size=5))
def test_batched_latencies_equal_the_sdk_histogram_value_by_value(batches):
    ours = LatencyHistograms("0")
    for batch in batches:
        ours.add("allocate", batch)
    (point,) = ours.metric().data.data_points
    expected = _sdk_point(batches)
    assert list(point.bucket_counts) == list(expected.bucket_counts)
    assert point.count == expected.count
    assert abs(point.sum - expected.sum) <= 1e-9 * max(1.0, abs(expected.sum))
    assert (point.min, point.max) == (expected.min, expected.max)
    assert list(point.explicit_bounds) == list(expected.explicit_bounds)
    assert dict(point.attributes) == {"engine": "0", "op": "allocate"}


def test_latencies_reach_an_otlp_receiver_as_one_histogram_per_op():
    with OtlpReceiver() as receiver:
        exporter = OtelKVExporter(receiver.url, engine="3", export_interval_ms=3_600_000)
        exporter.set_static("token", 1, 1024, 1 << 20)  # as the scheduler does at start-up
        exporter.publish(STATS)
        exporter.observe_latencies("allocate", [2e-6] * 40 + [3e-3] * 2)
        exporter.observe_latencies("allocate", [2e-6] * 8)
        exporter.observe_latencies("step", [1e-4])
        exporter.meter_provider.force_flush()
        exporter.shutdown()
        points = receiver.histogram_points(c.ALLOCATOR_LATENCY.name)
        # The gauges travel in the same export, not replaced by the latencies.
        assert receiver.gauge_points(c.SLOTS_USED.name)[-1].as_int == STATS.slots_used
    by_op = {next(a.value.string_value for a in p.attributes if a.key == "op"): p for p in points}
    assert set(by_op) == {"allocate", "step"}
    allocate = by_op["allocate"]
    assert allocate.count == 50
    assert allocate.bucket_counts[BOUNDS.index(2.5e-6)] == 48
    assert allocate.bucket_counts[BOUNDS.index(5e-3)] == 2
    assert {a.key: a.value.string_value for a in allocate.attributes}["engine"] == "3"


def test_export_from_the_generic_otel_endpoint_is_announced(monkeypatch):
    for name in ("PROXIMA_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    # Listen on the exporter's own "vllm." logger: vLLM's logging setup (run by any earlier test
    # that imported vLLM) stops it from propagating to caplog's root handler.
    from proxima.metrics import otel

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    otel.logger.addHandler(handler)
    level = otel.logger.level
    otel.logger.setLevel(logging.INFO)
    try:
        exporter = OtelKVExporter(otlp_endpoint_from_env(), export_interval_ms=3_600_000)
    finally:
        otel.logger.removeHandler(handler)
        otel.logger.setLevel(level)
    exporter.shutdown()
    lines = [r.getMessage() for r in records if "OTLP" in r.getMessage()]
    assert len(lines) == 1, lines
    line = lines[0]
    for part in ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9/v1/metrics",
                 "http://127.0.0.1:9/v1/traces", "span per finished request"):
        assert part in line, line
