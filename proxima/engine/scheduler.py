"""vLLM's scheduler with Proxima's slot manager and KV telemetry.

`proxima serve` passes `--scheduler-cls proxima.engine.scheduler.ProximaScheduler`. With
PROXIMA_ALLOCATOR=token the scheduler's KV manager is `SlotKVCacheManager` (block size 1); with
`block` it keeps vLLM's own manager untouched and only observes it, so an A/B run compares the
two allocators under identical telemetry. This module only hooks vLLM's scheduler (install the
manager, time steps, publish, count preemptions and finished requests); what the KV cache holds
is read by the allocator's own source (`kv_sources.py`), never from the manager's insides here.

vLLM 0.26 picks `AsyncScheduler` itself when async scheduling is on; `__new__` keeps that
choice by returning the async variant, so Proxima never changes how steps overlap.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

from prometheus_client import CollectorRegistry
from vllm.v1.core.sched import scheduler as vllm_scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from proxima.engine.compat import unsupported_options
from proxima.engine.kv_manager import OpTimings, SlotKVCacheManager
from proxima.engine.kv_sources import BlockPoolKVSource, KVSource, SlotKVSource
from proxima.engine.observed import report_step
from proxima.engine.settings import ProximaConfigError, ProximaSettings
from proxima.metrics.kv_stats import KVStats
from proxima.metrics.otel_env import RequestKVFacts, otlp_endpoint_from_env
from proxima.metrics.prometheus import PrometheusKVExporter
from proxima.metrics.sink import FailOpenSinks

# Under "vllm." so the line lands in the server log with vLLM's own handlers and format.
logger = logging.getLogger(f"vllm.{__name__}")


@contextlib.contextmanager
def _slot_manager_in_place(prefix_caching: bool, exact_figures: bool):
    """vLLM 0.26 builds its manager inline in Scheduler.__init__; swap the class it names for
    the constructor's duration, so the stock manager (one Python object per block) is never built."""
    original = vllm_scheduler.KVCacheManager
    vllm_scheduler.KVCacheManager = functools.partial(SlotKVCacheManager, prefix_caching=prefix_caching,
                                                      exact_figures=exact_figures)
    try:
        yield
    finally:
        vllm_scheduler.KVCacheManager = original


class ProximaScheduler(Scheduler):
    def __new__(cls, vllm_config, *args, **kwargs):
        if cls is ProximaScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = ProximaAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config, kv_cache_config, *args, **kwargs) -> None:
        settings = ProximaSettings.from_env()
        if settings.allocator is None:
            raise ProximaConfigError(
                "ProximaScheduler needs PROXIMA_ALLOCATOR=token or block in the environment; "
                "`proxima serve` sets it"
            )
        self.proxima_allocator = settings.allocator
        self.telemetry_on = settings.telemetry
        self.telemetry_interval_s = settings.telemetry_interval_s
        # Block-granular disclosure of prefix hits applies where hits are token-exact: token slots.
        self.round_prefill_stats = settings.token_slots and not settings.exact_kv_figures
        if settings.token_slots:
            problems = unsupported_options(vllm_config)
            if problems:
                raise ProximaConfigError("Proxima cannot serve: " + "; ".join(problems))
            prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
            with _slot_manager_in_place(prefix_caching, settings.exact_kv_figures):
                super().__init__(vllm_config, kv_cache_config, *args, **kwargs)
            # The slot cache matches token ids itself: without this, the engine core (which reads
            # the flag right after building the scheduler) would hash every token of every
            # request for a block cache that does not exist.
            vllm_config.cache_config.enable_prefix_caching = False
        else:
            super().__init__(vllm_config, kv_cache_config, *args, **kwargs)

        # vLLM 0.26 resets data_parallel_rank to 0 in every engine of a dense model; the index is
        # each engine's own (what vLLM's metrics label engine=), so DP engines never share series.
        engine = str(vllm_config.parallel_config.data_parallel_index)
        self.kv_exporter = PrometheusKVExporter(CollectorRegistry(), engine=engine)
        # Every sink call below goes through a guard: a failing exporter must not stop the engine.
        self.kv_sinks = FailOpenSinks(self.kv_exporter.count_telemetry_error)
        self.kv_sinks.add("prometheus", self.kv_exporter)
        self.otel_exporter = None
        endpoint = otlp_endpoint_from_env()
        if endpoint is not None:
            from proxima.metrics.otel import OtelKVExporter

            self.otel_exporter = self.kv_sinks.add("otlp", OtelKVExporter(endpoint, engine=engine))
        # Slots each live request has held at most (kept across preemptions), for request spans.
        self._kv_peak: dict[str, int] = {}
        # Step times, and with token slots the manager's allocate/free times, until the next publish.
        self._timings = OpTimings()
        self.kv_source: KVSource = (
            SlotKVSource(self.kv_cache_manager, settings.allocator,
                         self._timings if settings.telemetry else None, exact=settings.exact_kv_figures)
            if settings.token_slots else
            BlockPoolKVSource(self.kv_cache_manager, settings.allocator, self.block_size))
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        num_layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
        bytes_per_token = spec.page_size_bytes * num_layers // spec.block_size
        cache_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        kv_figures = "exact" if settings.exact_kv_figures or not settings.token_slots else "block"
        for sink in self.kv_sinks:
            sink.set_static(settings.allocator, self.kv_source.granularity, bytes_per_token, cache_bytes,
                            kv_figures)
        self._published_at = float("-inf")
        self.last_kv_stats: KVStats | None = None
        logger.info(
            "Proxima: allocator=%s slots=%d kv_bytes_per_token=%d kv_cache_bytes=%d "
            "prefix_cache=%s kv_figures=%s", settings.allocator, kv_cache_config.num_blocks * spec.block_size,
            bytes_per_token, cache_bytes, "on" if self.kv_source.prefix_caching else "off", kv_figures,
        )

    def schedule(self, *args, **kwargs):
        start = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        if self.round_prefill_stats and output.scheduled_new_reqs:
            self._disclose_prefill_hits(output.scheduled_new_reqs)
        end = published = time.perf_counter()
        # Collecting and exporting every step cost 110 us a step, 1.5% of the tiny CPU model's
        # engine time (scripts/bench_telemetry_overhead.py --interval 0; 29 us and 0.4% at the
        # default interval). While busy, refresh at most once per interval; an idle step (the
        # last before the engine sleeps) always publishes, so what a scrape reads at rest is exact.
        if self.telemetry_on:
            self._timings.step.append(end - start)
            if not self.running or end - self._published_at >= self.telemetry_interval_s:
                self._published_at = end
                self.publish_kv_telemetry()
                published = time.perf_counter()
        report_step(self, self.kv_sinks, output, end - start, published - end)
        return output

    def publish_kv_telemetry(self) -> None:
        """Collect the KV state now and hand it, with every latency timed since, to the sinks.

        Collection fails open like the sinks: an exception here is counted and logged as sink
        `collect`, and the step goes on (vLLM's busy loop treats a scheduler exception as fatal)."""
        try:
            self.last_kv_stats = self._collect_stats()
        except Exception as err:  # noqa: BLE001 (telemetry must never take serving down)
            self.kv_sinks.failed("collect", "_collect_stats", err)
            return
        timings = self._timings.drain()
        for sink in self.kv_sinks:
            for op, seconds in timings.items():
                sink.observe_latencies(op, seconds)
            sink.publish(self.last_kv_stats)

    def _disclose_prefill_hits(self, new_reqs) -> None:
        """A request's first schedule recorded its exact prefix hit in `prefill_stats`, which
        becomes the usage block's `cached_tokens` and vLLM's per-request hit metrics: count it in
        whole blocks before it leaves the engine (the hit itself is used exactly)."""
        disclosed = self.kv_cache_manager.disclosed
        for data in new_reqs:
            request = self.requests.get(data.req_id)
            stats = None if request is None else request.prefill_stats
            if stats is None or disclosed(stats.num_local_cached_tokens) == stats.num_local_cached_tokens:
                continue
            stats.set(num_prompt_tokens=stats.num_prompt_tokens,
                      num_local_cached_tokens=disclosed(stats.num_local_cached_tokens),
                      num_external_cached_tokens=stats.num_external_cached_tokens)

    def reset_prefix_cache(self, *args, **kwargs) -> bool:
        reset = super().reset_prefix_cache(*args, **kwargs)
        self._publish_outside_step()
        return reset

    def finish_requests(self, *args, **kwargs):
        finished = super().finish_requests(*args, **kwargs)
        if not self.running:  # an abort that leaves the engine at rest: no step follows to publish it
            self._publish_outside_step()
        return finished

    def _publish_outside_step(self) -> None:
        """The cache changed outside a step (POST /reset_prefix_cache, an abort): publish now, as
        an idle step would, so that a scrape at rest reads what the cache holds (before, the
        cached-slots gauge kept its old value after a reset: 5,575 slots that were gone)."""
        if self.telemetry_on:
            self._published_at = time.perf_counter()
            self.publish_kv_telemetry()

    def _preempt_request(self, request, timestamp: float) -> None:
        super()._preempt_request(request, timestamp)
        for sink in self.kv_sinks:
            sink.count_preemption()

    def _free_request_blocks(self, request) -> None:
        if self.otel_exporter is not None:
            rid = request.request_id
            self._kv_peak[rid] = max(self._kv_peak.get(rid, 0), self.kv_source.slots_held(rid))
        super()._free_request_blocks(request)

    def _free_blocks(self, request) -> None:
        super()._free_blocks(request)
        if self.otel_exporter is not None:
            self.otel_exporter.request_finished(RequestKVFacts(
                request_id=request.request_id,
                start_time_ns=int(request.arrival_time * 1e9),
                end_time_ns=time.time_ns(),
                slots_peak=self._kv_peak.pop(request.request_id, 0),
                preemptions=request.num_preemptions,
                prompt_tokens=request.num_prompt_tokens,
                output_tokens=request.num_output_tokens,
            ))

    def shutdown(self) -> None:
        if self.otel_exporter is not None:
            self.otel_exporter.shutdown()
        super().shutdown()

    def _collect_stats(self) -> KVStats:
        return self.kv_source.collect(self.running)


class ProximaAsyncScheduler(ProximaScheduler, AsyncScheduler):
    """The same, over vLLM's AsyncScheduler (chosen by ProximaScheduler.__new__)."""
