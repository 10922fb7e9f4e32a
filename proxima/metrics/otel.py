"""Publish the engine's KV telemetry through OpenTelemetry (OTLP over HTTP/protobuf).

The same facts as the Prometheus exporter, with the same names (from the catalog), plus one span
per finished request carrying its KV facts (slots held at peak, preemptions, tokens). Switched
on by an endpoint: `proxima serve --otlp-metrics-endpoint URL` (PROXIMA_OTLP_ENDPOINT in the
engine's environment) or the standard OTEL_EXPORTER_OTLP_[METRICS_]ENDPOINT variables. The SDK's
providers are created here and passed around, never installed as process globals.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from operator import attrgetter

from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from proxima.metrics import catalog as c
from proxima.metrics.kv_stats import KVStats
from proxima.metrics.otel_env import RequestKVFacts, otlp_endpoint_source, signal_url
from proxima.metrics.otel_latency import SCOPE, LatencyHistograms, WithLatencies

SPAN_NAME = "proxima.kv.request"

# Under "vllm." so the line lands in the server log with vLLM's own handlers and format.
logger = logging.getLogger(f"vllm.{__name__}")


class OtelKVExporter:
    def __init__(self, endpoint: str, engine: str = "0", export_interval_ms: int | None = None) -> None:
        self.engine = engine
        self._attrs = {"engine": engine}
        self._lock = threading.Lock()
        self._stats: KVStats | None = None
        self._static: dict[str, float] = {}
        self._info: dict[str, str] = {}
        resource = Resource.create({"service.name": "proxima-engine", SCOPE: engine})
        interval = export_interval_ms or int(os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "10000"))
        # Latencies are bucketed here in batches and joined to each export (otel_latency.py).
        self._latencies = LatencyHistograms(engine)
        exporter = WithLatencies(OTLPMetricExporter(endpoint=signal_url(endpoint, "metrics")),
                                 self._latencies, resource)
        self._reader = PeriodicExportingMetricReader(exporter, export_interval_millis=interval)
        self.meter_provider = MeterProvider(resource=resource, metric_readers=[self._reader])
        self.tracer_provider = TracerProvider(resource=resource)
        self.tracer_provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=signal_url(endpoint, "traces")))
        )
        self._tracer = self.tracer_provider.get_tracer(SCOPE)
        # The generic OTEL_EXPORTER_OTLP_ENDPOINT (set for some other tool, perhaps) also switches
        # this on: say what goes where, once, so nobody exports request spans without knowing it.
        source = otlp_endpoint_source()
        origin = f" (from {source[1]})" if source and source[0] == endpoint.rstrip("/") else ""
        logger.info(
            "Proxima: OTLP export on%s: engine %s KV metrics every %.3gs to %s, one span per finished "
            "request (ids, token counts, KV slots) to %s",
            origin, engine, interval / 1000, signal_url(endpoint, "metrics"), signal_url(endpoint, "traces"),
        )
        meter = self.meter_provider.get_meter(SCOPE)
        self._preemptions = meter.create_counter(c.PREEMPTIONS.sample_name, description=c.PREEMPTIONS.help)
        # Every figure the catalog gives a `stat`, read from the last published KVStats at export.
        for spec in c.published():
            read = attrgetter(spec.stat)
            if spec.read is c.Read.SEGMENTS:
                meter.create_observable_gauge(spec.name, callbacks=[self._observe_segments(read)],
                                              description=spec.help)
            elif spec.kind is c.Kind.COUNTER:
                meter.create_observable_counter(spec.sample_name, callbacks=[self._observe(read)],
                                                description=spec.help)
            else:
                meter.create_observable_gauge(spec.name, callbacks=[self._observe(read)],
                                              description=spec.help)
        for spec in (c.BYTES_PER_TOKEN, c.CACHE_BYTES):
            meter.create_observable_gauge(spec.name, callbacks=[self._observe_static(spec.name)],
                                          description=spec.help)
        meter.create_observable_gauge(c.ALLOCATOR_INFO.name, callbacks=[self._observe_info],
                                      description=c.ALLOCATOR_INFO.help)

    # -- the sink interface the scheduler calls -----------------------------------------------

    def set_static(self, allocator: str, granularity: int, bytes_per_token: int, cache_bytes: int,
                   kv_figures: str = "exact") -> None:
        self._info = {"allocator": allocator, "block_size": str(granularity), "kv_figures": kv_figures}
        self._static = {c.BYTES_PER_TOKEN.name: bytes_per_token, c.CACHE_BYTES.name: cache_bytes}

    def observe_latencies(self, op: str, seconds: Sequence[float]) -> None:
        self._latencies.add(op, seconds)

    def count_preemption(self) -> None:
        self._preemptions.add(1, self._attrs)

    def publish(self, stats: KVStats) -> None:
        with self._lock:
            self._stats = stats

    def request_finished(self, facts: RequestKVFacts) -> None:
        span = self._tracer.start_span(SPAN_NAME, start_time=facts.start_time_ns)
        span.set_attributes({
            SCOPE: self.engine,
            "proxima.request_id": facts.request_id,
            "proxima.kv.slots_peak": facts.slots_peak,
            "proxima.kv.preemptions": facts.preemptions,
            "proxima.kv.preempted": facts.preemptions > 0,
            "proxima.request.prompt_tokens": facts.prompt_tokens,
            "proxima.request.output_tokens": facts.output_tokens,
        })
        span.end(end_time=facts.end_time_ns)

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()

    # -- observable callbacks (run on the SDK's export thread) --------------------------------

    def _observe(self, read):
        def callback(options: CallbackOptions):
            with self._lock:
                stats = self._stats
            value = None if stats is None else read(stats)
            # None: a figure not disclosed under block-granular figures (KVStats.exact)
            return [] if value is None else [Observation(value, self._attrs)]
        return callback

    def _observe_static(self, name: str):
        def callback(options: CallbackOptions):
            return [Observation(self._static[name], self._attrs)] if name in self._static else []
        return callback

    def _observe_segments(self, read):
        def callback(options: CallbackOptions):
            with self._lock:
                stats = self._stats
            values = None if stats is None else read(stats)
            if values is None:
                return []
            return [Observation(v, {"engine": self.engine, "segment": str(i)})
                    for i, v in enumerate(values)]
        return callback

    def _observe_info(self, options: CallbackOptions):
        return [Observation(1, {"engine": self.engine, **self._info})] if self._info else []
