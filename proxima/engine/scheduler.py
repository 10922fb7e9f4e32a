"""vLLM's scheduler with Proxima's slot manager and KV telemetry.

`proxima serve` passes `--scheduler-cls proxima.engine.scheduler.ProximaScheduler`. With
PROXIMA_ALLOCATOR=token the scheduler's KV manager is `SlotKVCacheManager` (block size 1); with
`block` it keeps vLLM's own manager untouched and only observes it, so an A/B run compares the
two allocators under identical telemetry.

vLLM 0.26 picks `AsyncScheduler` itself when async scheduling is on; `__new__` keeps that
choice by returning the async variant, so Proxima never changes how steps overlap.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

import numpy as np
from prometheus_client import CollectorRegistry
from vllm.v1.core.sched import scheduler as vllm_scheduler
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from proxima.engine import kv_stats
from proxima.engine.compat import unsupported_options
from proxima.engine.kv_manager import OpTimings, SlotKVCacheManager
from proxima.engine.settings import ProximaConfigError, ProximaSettings
from proxima.metrics import catalog
from proxima.metrics.otel_env import RequestKVFacts, otlp_endpoint_from_env
from proxima.metrics.prometheus import PrometheusKVExporter
from proxima.metrics.sink import FailOpenSinks

# Under "vllm." so the line lands in the server log with vLLM's own handlers and format.
logger = logging.getLogger(f"vllm.{__name__}")

# Occupancy map and largest free run scan every slot: refresh them at most this often.
SLOW_STATS_INTERVAL_S = 0.5


@contextlib.contextmanager
def _slot_manager_in_place(prefix_caching: bool):
    """vLLM 0.26 builds its manager inline in Scheduler.__init__; swap the class it names for
    the constructor's duration, so the stock manager (one Python object per block) is never built."""
    original = vllm_scheduler.KVCacheManager
    vllm_scheduler.KVCacheManager = functools.partial(SlotKVCacheManager,
                                                      prefix_caching=prefix_caching)
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
        if settings.token_slots:
            problems = unsupported_options(vllm_config)
            if problems:
                raise ProximaConfigError("Proxima cannot serve: " + "; ".join(problems))
            prefix_caching = bool(vllm_config.cache_config.enable_prefix_caching)
            with _slot_manager_in_place(prefix_caching):
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
        self._granularity = 1 if settings.token_slots else self.block_size
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        num_layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
        bytes_per_token = spec.page_size_bytes * num_layers // spec.block_size
        cache_bytes = sum(t.size for t in kv_cache_config.kv_cache_tensors)
        for sink in self.kv_sinks:
            sink.set_static(settings.allocator, self._granularity, bytes_per_token, cache_bytes)
        # Step times, and with token slots the manager's allocate/free times, until the next publish.
        self._timings = OpTimings()
        if isinstance(self.kv_cache_manager, SlotKVCacheManager) and settings.telemetry:
            self.kv_cache_manager.timings = self._timings
        self._slow_stats_at = 0.0
        self._published_at = float("-inf")
        self._occupancy: tuple[float, ...] = ()
        self._largest_free_run = 0
        self._stock_cached_slots = 0
        self._stock_shared_slots = 0
        self.last_kv_stats: kv_stats.KVStats | None = None
        mgr = self.kv_cache_manager
        caching = mgr.prefix_caching if isinstance(mgr, SlotKVCacheManager) else mgr.enable_caching
        logger.info(
            "Proxima: allocator=%s slots=%d kv_bytes_per_token=%d kv_cache_bytes=%d "
            "prefix_cache=%s", settings.allocator, kv_cache_config.num_blocks * spec.block_size,
            bytes_per_token, cache_bytes, "on" if caching else "off",
        )

    def schedule(self, *args, **kwargs):
        start = time.perf_counter()
        output = super().schedule(*args, **kwargs)
        if not self.telemetry_on:
            return output
        end = time.perf_counter()
        self._timings.step.append(end - start)
        # Collecting and exporting every step cost 110 us a step, 1.5% of the tiny CPU model's
        # engine time (scripts/bench_telemetry_overhead.py --interval 0; 29 us and 0.4% at the
        # default interval). While busy, refresh at most once per interval; an idle step (the
        # last before the engine sleeps) always publishes, so what a scrape reads at rest is exact.
        if self.running and end - self._published_at < self.telemetry_interval_s:
            return output
        self._published_at = end
        self.publish_kv_telemetry()
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

    def _preempt_request(self, request, timestamp: float) -> None:
        super()._preempt_request(request, timestamp)
        for sink in self.kv_sinks:
            sink.count_preemption()

    def _free_request_blocks(self, request) -> None:
        if self.otel_exporter is not None:
            rid = request.request_id
            self._kv_peak[rid] = max(self._kv_peak.get(rid, 0), self._slots_held(rid))
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

    def _slots_held(self, request_id: str) -> int:
        mgr = self.kv_cache_manager
        if isinstance(mgr, SlotKVCacheManager):
            return mgr.table.num_slots(request_id)
        blocks = mgr.coordinator.single_type_managers[0].req_to_blocks.get(request_id, ())
        return len(blocks) * self.block_size

    def _collect_stats(self) -> kv_stats.KVStats:
        live = np.fromiter(
            (r.num_computed_tokens for r in self.running), dtype=np.int64, count=len(self.running)
        )
        mgr = self.kv_cache_manager
        live_tokens = int(live.sum())
        reference_slots = kv_stats.block_slots(live, catalog.REFERENCE_BLOCK_SIZE)
        prefix = kv_stats.PrefixCacheTotals()
        if isinstance(mgr, SlotKVCacheManager):
            cache = mgr.cache
            total, used, cached = cache.num_slots, cache.num_referenced, cache.num_cached
            in_use = lambda: mgr.allocator.in_use  # noqa: E731
            num_requests = len(mgr.table)
            # A slot k requests share counts once; so do the full blocks a 16-token block cache
            # would have shared for the same requests.
            live_tokens -= cache.tree.shared_excess
            reference_slots -= cache.tree.shared_excess_blocks
            counters = cache.counters
            prefix = kv_stats.PrefixCacheTotals(counters.hit_tokens, counters.hit_tokens_beyond_blocks,
                                                counters.evicted_tokens)
        else:
            total, used, in_use, num_requests = self._stock_block_state()
            cached = self._stock_cached_slots
        now = time.monotonic()
        # Always refresh on an idle step: it is the last publish before the engine sleeps.
        if not self.running or now - self._slow_stats_at >= SLOW_STATS_INTERVAL_S:
            occupied = in_use()
            self._occupancy = kv_stats.downsample_occupancy(occupied, catalog.OCCUPANCY_SEGMENTS)
            self._largest_free_run = kv_stats.largest_free_run(occupied)
            if not isinstance(mgr, SlotKVCacheManager):
                self._stock_cached_slots, self._stock_shared_slots = self._count_stock_sharing()
                cached = self._stock_cached_slots
            self._slow_stats_at = now
        if not isinstance(mgr, SlotKVCacheManager):
            # vLLM's prefix cache shares whole blocks: each shared block's tokens count once (as of
            # the last slow refresh, which every idle step makes).
            live_tokens = max(0, live_tokens - self._stock_shared_slots)
            reference_slots = max(0, reference_slots - self._stock_shared_slots)
        return kv_stats.KVStats(
            allocator=self.proxima_allocator,
            granularity=self._granularity,
            slots_total=total,
            slots_used=used,
            slots_cached=cached,
            live_tokens=live_tokens,
            num_requests=num_requests,
            reference_block=catalog.REFERENCE_BLOCK_SIZE,
            reference_block_slots=reference_slots,
            prefix=prefix,
            occupancy=self._occupancy,
            largest_free_run=self._largest_free_run,
        )

    def _stock_block_state(self):
        """Read vLLM's block pool in slot units (block 0 is vLLM's reserved null block)."""
        pool = self.kv_cache_manager.block_pool
        b = self.block_size
        num_blocks = pool.num_gpu_blocks - 1
        used_blocks = num_blocks - pool.get_num_free_blocks()
        managers = self.kv_cache_manager.coordinator.single_type_managers
        num_requests = len(managers[0].req_to_blocks)

        def in_use() -> np.ndarray:
            per_block = np.fromiter((blk.ref_cnt > 0 for blk in pool.blocks[1:]), dtype=np.bool_,
                                    count=num_blocks)
            return np.repeat(per_block, b)

        return num_blocks * b, used_blocks * b, in_use, num_requests

    def _count_stock_sharing(self) -> tuple[int, int]:
        """Free blocks that still hold a prefix-cache entry (reusable without recompute), and the
        slots requests share beyond the first holder of each block, both in slots."""
        if not self.kv_cache_manager.enable_caching:
            return 0, 0
        pool, b = self.kv_cache_manager.block_pool, self.block_size
        cached = shared = 0
        for blk in pool.blocks[1:]:
            if blk.ref_cnt > 1:
                shared += blk.ref_cnt - 1
            elif blk.ref_cnt == 0 and blk.block_hash is not None:
                cached += 1
        return cached * b, shared * b


class ProximaAsyncScheduler(ProximaScheduler, AsyncScheduler):
    """The same, over vLLM's AsyncScheduler (chosen by ProximaScheduler.__new__)."""
