"""Allocator latencies for OTLP, bucketed on the engine thread in one numpy pass per batch.

The SDK's `Histogram.record` costs about 10 us per value on the engine thread (attributes
frozen, a measurement built, a lock and a bisect per value), and a decode step hands over one
value per running request and operation. Here a batch costs one searchsorted + bincount into
cumulative per-op arrays, and the export thread turns them into the OTLP histogram: a
`MetricExporter` wrapper adds them to each export as public SDK data points (cumulative, the
same buckets the catalog gives Prometheus). tests/test_otel_export.py checks the points against
the SDK's own histogram fed value by value; scripts/bench_otlp_export.py measures both.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Histogram,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    ResourceMetrics,
    ScopeMetrics,
)
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from proxima.metrics import catalog as c

# The instrumentation scope of every Proxima instrument and span, and the resource and span
# attribute that names the engine (one wire name for both, as the exports have always used).
SCOPE = "proxima.engine"


class LatencyHistograms:
    """Cumulative explicit-bucket histograms, one per allocator op, fed in batches."""

    def __init__(self, engine: str, bounds: Sequence[float] = c.ALLOCATOR_LATENCY.buckets) -> None:
        self.engine = engine
        self.bounds = np.asarray(bounds, dtype=np.float64)
        self._start_ns = time.time_ns()
        self._lock = threading.Lock()  # the engine thread adds, the export thread reads
        self._counts: dict[str, np.ndarray] = {}
        self._sum: dict[str, float] = {}
        self._min: dict[str, float] = {}
        self._max: dict[str, float] = {}

    def add(self, op: str, seconds: Sequence[float]) -> None:
        if not len(seconds):
            return
        samples = np.asarray(seconds, dtype=np.float64)
        # OTel's explicit buckets are (b[i-1], b[i]]: a value on a bound goes to the bucket it closes.
        counts = np.bincount(np.searchsorted(self.bounds, samples, side="left"),
                             minlength=len(self.bounds) + 1)
        low, high, total = float(samples.min()), float(samples.max()), float(samples.sum())
        with self._lock:
            if op in self._counts:
                self._counts[op] += counts
                self._sum[op] += total
                self._min[op] = min(self._min[op], low)
                self._max[op] = max(self._max[op], high)
            else:
                self._counts[op], self._sum[op], self._min[op], self._max[op] = counts, total, low, high

    def metric(self) -> Metric | None:
        """The OTLP histogram of everything added since start (None before the first value)."""
        now = time.time_ns()
        with self._lock:
            points = [
                HistogramDataPoint(
                    attributes={"engine": self.engine, "op": op}, start_time_unix_nano=self._start_ns,
                    time_unix_nano=now, count=int(counts.sum()), sum=self._sum[op],
                    bucket_counts=[int(n) for n in counts], explicit_bounds=self.bounds.tolist(),
                    min=self._min[op], max=self._max[op],
                )
                for op, counts in self._counts.items()
            ]
        if not points:
            return None
        spec = c.ALLOCATOR_LATENCY
        return Metric(name=spec.name, description=spec.help, unit="s",
                      data=Histogram(data_points=points,
                                     aggregation_temporality=AggregationTemporality.CUMULATIVE))


class WithLatencies(MetricExporter):
    """Wraps the OTLP exporter: each export also carries `LatencyHistograms`' current points.

    The SDK exports only when some instrument has data; the allocator-info gauge has from
    start-up (`set_static`), so every periodic export carries the latencies."""

    def __init__(self, inner: MetricExporter, latencies: LatencyHistograms, resource: Resource) -> None:
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self._inner, self._latencies, self._resource = inner, latencies, resource

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000,
               **kwargs) -> MetricExportResult:
        metric = self._latencies.metric()
        if metric is not None:
            metrics_data = _with_metric(metrics_data, metric, self._resource)
        return self._inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return self._inner.force_flush(timeout_millis=timeout_millis)

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._inner.shutdown(timeout_millis=timeout_millis, **kwargs)


def _with_metric(data: MetricsData, metric: Metric, resource: Resource) -> MetricsData:
    if not data.resource_metrics:
        scope = ScopeMetrics(scope=InstrumentationScope(SCOPE), metrics=[metric], schema_url="")
        return MetricsData(resource_metrics=[ResourceMetrics(resource=resource, scope_metrics=[scope],
                                                             schema_url="")])
    first, *rest = data.resource_metrics
    # Into the engine meter's own scope: the OTLP encoder keys scopes by name, so a second
    # ScopeMetrics of the same name would replace the gauges instead of joining them.
    scopes, joined = [], False
    for sm in first.scope_metrics:
        if sm.scope.name == SCOPE and not joined:
            sm = ScopeMetrics(scope=sm.scope, metrics=[*sm.metrics, metric], schema_url=sm.schema_url)
            joined = True
        scopes.append(sm)
    if not joined:
        scopes.append(ScopeMetrics(scope=InstrumentationScope(SCOPE), metrics=[metric], schema_url=""))
    first = ResourceMetrics(resource=first.resource, scope_metrics=scopes, schema_url=first.schema_url)
    return MetricsData(resource_metrics=[first, *rest])
