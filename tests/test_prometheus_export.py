"""The Prometheus exporter's batch histogram observation equals prometheus_client's own observe()."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

from proxima.metrics import catalog as c
from proxima.metrics.prometheus import BatchObserver

BOUNDS = list(c.ALLOCATOR_LATENCY.buckets)
# Values on, just below and just above every bucket bound, plus anything in range.
EDGES = [b for bound in BOUNDS if bound != float("inf") for b in (bound, bound * 0.999, bound * 1.001)]
VALUES = st.one_of(st.sampled_from(EDGES + [0.0]), st.floats(0, 10, allow_nan=False))


def _histogram_samples(fill) -> dict:
    registry = CollectorRegistry()
    histogram = Histogram("h_seconds", "h", ["op"], registry=registry, buckets=BOUNDS)
    fill(histogram.labels(op="allocate"))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for metric in registry.collect() for s in metric.samples if not s.name.endswith("_created")}


@settings(max_examples=200)
@given(st.lists(VALUES, max_size=300))
def test_batch_observe_equals_one_observe_per_value(values: list[float]) -> None:
    def one_by_one(h):
        for v in values:
            h.observe(v)

    batched = _histogram_samples(lambda h: BatchObserver(h).observe(values))
    expected = _histogram_samples(one_by_one)
    assert batched.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(batched[key] - value) <= 1e-9 * max(1.0, abs(value)), key
