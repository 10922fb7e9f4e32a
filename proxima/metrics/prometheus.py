"""Publish the engine's KV telemetry as Prometheus metrics, built from the catalog.

Runs in the process that owns the allocator (vLLM's EngineCore). `proxima serve` sets
PROMETHEUS_MULTIPROC_DIR before vLLM starts, so prometheus_client writes these values to
shared files and vLLM's API server serves them on its own `/metrics` beside `vllm:*`.
The registry is passed in (tests use a fresh one); nothing here is process-global.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from proxima.metrics import catalog as c
from proxima.metrics.kv_stats import KVStats


def _make(spec: c.MetricSpec, registry: CollectorRegistry):
    if spec.kind is c.Kind.GAUGE:
        return Gauge(spec.name, spec.help, spec.labels, registry=registry,
                     multiprocess_mode=spec.multiprocess_mode)
    if spec.kind is c.Kind.COUNTER:
        return Counter(spec.name, spec.help, spec.labels, registry=registry)
    return Histogram(spec.name, spec.help, spec.labels, registry=registry, buckets=spec.buckets)


# Below this many values a plain loop of observe() is cheaper than one numpy pass.
_BATCH_MIN = 8


class BatchObserver:
    """``histogram.observe(v)`` for every value of a batch, in one pass when there are many.

    prometheus_client has no batch observe, and one call costs 0.65 us against 0.09 us per value
    here (scripts/bench_host_path.py, in-process registry; in multiprocess mode each call also
    writes to a shared file). Every decode step allocates for every running request, and the
    scheduler hands over all the timings since its last publish at once: bucket them with numpy
    and add each bucket's count once. This reads the histogram child's own fields
    (``_upper_bounds``, ``_buckets``, ``_sum``, prometheus-client 0.26), looked up once here, not
    per step; tests/test_prometheus_export.py checks the result against observe() value by
    value, and a client without those fields gets the plain loop.
    """

    def __init__(self, histogram) -> None:
        self._histogram = histogram
        fields = all(hasattr(histogram, a) for a in ("_upper_bounds", "_buckets", "_sum"))
        self._bounds = np.asarray(histogram._upper_bounds, dtype=np.float64) if fields else None

    def observe(self, values: Sequence[float]) -> None:
        h = self._histogram
        if self._bounds is None or len(values) < _BATCH_MIN:
            for value in values:
                h.observe(value)
            return
        samples = np.asarray(values, dtype=np.float64)
        # observe() counts a value in the first bucket whose upper bound is >= it (the last is +Inf).
        counts = np.bincount(np.searchsorted(self._bounds, samples, side="left"), minlength=len(self._bounds))
        h._sum.inc(float(samples.sum()))
        for bucket in np.flatnonzero(counts):
            h._buckets[bucket].inc(int(counts[bucket]))


class PrometheusKVExporter:
    """One engine's metrics in a registry; `publish` sets every catalog figure that has a `stat`."""

    def __init__(self, registry: CollectorRegistry, engine: str = "0") -> None:
        self.engine = engine
        self.registry = registry
        self._m = {spec.name: _make(spec, registry) for spec in c.ENGINE_METRICS}
        self._latency = {
            op: BatchObserver(self._m[c.ALLOCATOR_LATENCY.name].labels(engine=engine, op=op))
            for op in c.ALLOCATOR_OPS
        }
        self._preemptions = self._m[c.PREEMPTIONS.name].labels(engine=engine)
        # Labelled children and readers resolved once: publish runs up to once per scheduler step.
        self._gauges: list[tuple[object, attrgetter]] = []
        self._counters: list[tuple[object, attrgetter, str]] = []
        self._maps: list[tuple[list, attrgetter, str]] = []
        for spec in c.published():
            metric, read = self._m[spec.name], attrgetter(spec.stat)
            if spec.read is c.Read.SEGMENTS:
                children = [metric.labels(engine=engine, segment=str(i)) for i in range(c.OCCUPANCY_SEGMENTS)]
                self._maps.append((children, read, spec.name))
            elif spec.kind is c.Kind.COUNTER:  # a cumulative total: the counter moves by the increase
                self._counters.append((metric.labels(engine=engine), read, spec.name))
            else:
                self._gauges.append((metric.labels(engine=engine), read))
        self._shown: dict[str, object] = {}  # each counter's total and each map as last published
        # Children made now, so every sink's counter reads 0 from the start (rate() needs a first point).
        errors = self._m[c.TELEMETRY_ERRORS.name]
        self._telemetry_errors = {sink: errors.labels(engine=engine, sink=sink) for sink in c.TELEMETRY_SINKS}

    def count_telemetry_error(self, sink: str) -> None:
        """One exception caught from sink `sink` (FailOpenSinks' counter)."""
        counter = self._telemetry_errors.get(sink)
        if counter is None:  # sink names are the scheduler's constants: the label set stays bounded
            counter = self._telemetry_errors[sink] = self._m[c.TELEMETRY_ERRORS.name].labels(
                engine=self.engine, sink=sink)
        counter.inc()

    def set_static(self, allocator: str, granularity: int, bytes_per_token: int, cache_bytes: int,
                   kv_figures: str = "exact") -> None:
        self._m[c.ALLOCATOR_INFO.name].labels(
            engine=self.engine, allocator=allocator, block_size=str(granularity), kv_figures=kv_figures,
        ).set(1)
        for spec, value in ((c.BYTES_PER_TOKEN, bytes_per_token), (c.CACHE_BYTES, cache_bytes)):
            self._m[spec.name].labels(engine=self.engine).set(value)

    def observe_latencies(self, op: str, seconds: Sequence[float]) -> None:
        self._latency[op].observe(seconds)

    def count_preemption(self) -> None:
        self._preemptions.inc()

    def request_finished(self, facts) -> None:
        """Per-request facts go to traces (OpenTelemetry), not to Prometheus."""

    def publish(self, stats: KVStats) -> None:
        # A figure that is None is not disclosed (KVStats.exact): its series is never written.
        for gauge, read in self._gauges:
            value = read(stats)
            if value is not None:
                gauge.set(value)
        shown = self._shown
        for counter, read, name in self._counters:
            now = read(stats)
            if now is None:
                continue
            if now > shown.get(name, 0):
                counter.inc(now - shown.get(name, 0))
            shown[name] = now
        # The map is refreshed every SLOW_STATS_INTERVAL_S, not every step: 64 sets only when it has.
        for children, read, name in self._maps:
            values = read(stats)
            if values is not None and values is not shown.get(name):
                for gauge, value in zip(children, values):
                    gauge.set(value)
                shown[name] = values
