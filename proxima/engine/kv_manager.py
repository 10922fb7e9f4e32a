"""vLLM's KVCacheManager interface, served by token-granular slots.

Layer: adapter. The scheduler calls this exactly as it calls vLLM's own `KVCacheManager`
(admission: `allocate_slots` returning None when full; release: `free`); underneath, a
`SlotAllocator` hands out single-token slots and a `RequestSlotTable` remembers each request's
slots in token order. With the KV block size set to 1, a "block id" is a slot id, so the
worker's block table is the per-token slot table the attention backend reads.

What it does not serve (refused at start-up by `compat.check`): prefix caching, KV connectors
(disaggregated prefill, offloading), sliding window / hybrid models, several KV cache groups.
The methods vLLM keeps for those features answer "nothing to do".

Ownership: a request's slots belong to it from `allocate_slots` until `free`; nothing else
writes the table. Call timings go to an injected `OpTimings` log, never to a global.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from proxima.engine.slot_allocator import SlotAllocator
from proxima.engine.slot_table import RequestSlotTable
from proxima.metrics.catalog import ALLOCATOR_OPS

# Under "vllm." so the line lands in the server log with vLLM's own handlers and format.
logger = logging.getLogger(f"vllm.{__name__}")

# Test-only fault injection: leak this many slots of every freed request (doctor's leak probe).
FAULT_LEAK_ENV = "PROXIMA_FAULT_LEAK_SLOTS"
CHECK_ENV = "PROXIMA_CHECK_INVARIANTS"


class OpTimings:
    """Seconds each timed operation took since the last `drain`: the slot manager's allocate and
    free calls, and the scheduler's steps.

    The scheduler drains it at each telemetry publish and exports the batch: one histogram
    observation per call cost 0.65 us, more than `allocate(1)` itself (0.41 us), against 0.09 us
    per value batched (scripts/bench_host_path.py).
    """

    # One list per `op` label of the latency histogram; the hot paths append to them by name.
    __slots__ = ALLOCATOR_OPS
    allocate: list[float]
    free: list[float]
    step: list[float]

    def __init__(self) -> None:
        for op in ALLOCATOR_OPS:
            setattr(self, op, [])

    def drain(self) -> dict[str, list[float]]:
        """Every list, by operation name, emptied."""
        drained = {op: getattr(self, op) for op in ALLOCATOR_OPS}
        for op in ALLOCATOR_OPS:
            setattr(self, op, [])
        return drained


class SlotBlocks(KVCacheBlocks):
    """A KVCacheBlocks whose "blocks" are slot ids, held as one int32 array (no block objects)."""

    def __init__(self, slots: np.ndarray) -> None:
        # `blocks` keeps the parent's shape (one group) for code that only checks emptiness.
        self.slots = slots
        self.blocks = ((),)

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        if allow_none and self.slots.size == 0:
            return None
        return (self.slots.tolist(),)

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        if not isinstance(other, SlotBlocks):
            raise TypeError(f"cannot add {type(other).__name__} to SlotBlocks")
        return SlotBlocks(np.concatenate((self.slots, other.slots)))

    def new_empty(self) -> SlotBlocks:
        return SlotBlocks(self.slots[:0])


_NO_SLOTS = np.empty(0, dtype=np.int32)


class SlotKVCacheManager:
    """Drop-in for vllm.v1.core.kv_cache_manager.KVCacheManager (same constructor keywords)."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: object | None = None,
        watermark: float = 0.0,
        timings: OpTimings | None = None,
    ) -> None:
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError(
                "Proxima's slot allocator serves models with one KV cache group; this model has "
                f"{len(kv_cache_config.kv_cache_groups)} (hybrid or sliding-window layers)."
            )
        if scheduler_block_size != 1:
            raise ValueError(
                f"Proxima's slot allocator needs KV block size 1, got {scheduler_block_size}."
            )
        self.max_model_len = max_model_len
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = 1
        self.log_stats = log_stats
        self.use_eagle = use_eagle
        # Prefix caching is not served by slots (compat.check switches it off with one line).
        self.enable_caching = False
        self.enable_kv_cache_events = False
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.allocator = SlotAllocator(
            kv_cache_config.num_blocks, check_invariants=os.environ.get(CHECK_ENV) == "1"
        )
        self.table = RequestSlotTable()
        self.watermark_slots = int(watermark * kv_cache_config.num_blocks)
        self.timings = timings
        self._leak_per_free = int(os.environ.get(FAULT_LEAK_ENV, "0") or 0)
        self.num_leaked_slots = 0
        self.empty_kv_cache_blocks = SlotBlocks(_NO_SLOTS)
        # vLLM reaches for these only with KV connectors, which Proxima refuses.
        self.block_pool = None
        self.coordinator = None

    # -- admission and allocation -------------------------------------------------------------

    @property
    def usage(self) -> float:
        return self.allocator.num_used / self.allocator.num_slots

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        return self.empty_kv_cache_blocks, 0, 0

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
    ) -> KVCacheBlocks | None:
        """Give the request a slot for every token it will hold after this step.

        Returns the newly allocated slots, or None (changing nothing) when they do not fit.
        """
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise ValueError("num_new_tokens must be greater than 0")
        start = time.perf_counter()
        request_id = request.request_id
        num_held = self.table.num_slots(request_id)
        num_computed = min(
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens,
            self.max_model_len,
        )
        reserve = reserved_blocks
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            reserve += self.watermark_slots
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if not self.allocator.can_allocate(max(0, full - num_held), reserve):
                return None
        num_needed = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_to_allocate = max(0, num_needed - num_held)
        if not self.allocator.can_allocate(num_to_allocate, reserve):
            return None
        slots = self.allocator.allocate(num_to_allocate)
        assert slots is not None  # can_allocate said they fit
        self.table.append(request_id, slots)
        if self.timings is not None:
            self.timings.allocate.append(time.perf_counter() - start)
        return SlotBlocks(slots) if num_to_allocate else self.empty_kv_cache_blocks

    def free(self, request: Request) -> None:
        start = time.perf_counter()
        slots = self.table.pop(request.request_id)
        if self._leak_per_free and slots.size:
            leaked = min(self._leak_per_free, slots.size)
            self.num_leaked_slots += leaked
            slots = slots[leaked:]
        self.allocator.free(slots)
        if self.timings is not None:
            self.timings.free.append(time.perf_counter() - start)

    # -- lookups ------------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        slots = self.table.slots_of(request_id)
        return SlotBlocks(slots.copy()) if slots.size else self.empty_kv_cache_blocks

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return (self.table.slots_of(request_id).tolist(),)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        return (self.table.slots_of(request_id)[:num_computed_tokens].tolist(),)

    def create_kv_cache_blocks(self, blocks: tuple[list, ...]) -> KVCacheBlocks:
        if not any(blocks):
            return self.empty_kv_cache_blocks
        raise NotImplementedError("Proxima's slot manager does not build KVCacheBlocks from blocks")

    # -- features Proxima refuses at start-up: nothing to do ---------------------------------

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        return None

    def reset_prefix_cache(self) -> bool:
        return True

    def evict_blocks(self, block_ids: set[int]) -> None:
        return None

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0]

    def estimate_cached_tokens(self, request: Request) -> int:
        return 0

    def take_events(self) -> list:
        return []

    def take_new_block_ids(self) -> list[int]:
        return []

    def get_zeroing_block_ids_in_range(self, request_id: str, start_token: int,
                                       end_token: int) -> list[int]:
        return []

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        return None

    def take_kv_cache_block_copies(self) -> tuple[list, list]:
        return [], []

    def pop_blocks_for_free(self, request: Request) -> list:
        raise NotImplementedError("deferred block frees need a KV connector, which Proxima refuses")

    def new_step_starts(self) -> None:
        return None
