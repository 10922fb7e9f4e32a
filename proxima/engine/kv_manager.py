"""vLLM's KVCacheManager interface, served by token-granular slots with a token-exact prefix cache.

Layer: adapter. The scheduler calls this exactly as it calls vLLM's own `KVCacheManager`
(lookup: `get_computed_blocks`; admission: `allocate_slots` returning None when full; release:
`free`); underneath, a `TokenSlotCache` hands out single-token slots, remembers each request's
slots in token order and shares cached prefixes through a radix tree. With the KV block size set
to 1, a "block id" is a slot id, so the worker's block table is the per-token slot table the
attention backend reads, and a shared slot simply appears in several requests' tables.

Prefix caching follows vLLM's rules at token granularity: a hit may have any length (stock
vLLM: whole blocks), the last prompt token is always recomputed (its logits are needed),
requests that skip the cache (prompt logprobs) never read it, and requests whose KV must not be
shared never meet: another LoRA adapter or `cache_salt` is another tree, prompt embeddings are
never cached, and a multimodal prompt is cached only up to its first placeholder.

What it does not serve (refused at start-up by `compat.unsupported_options`): KV connectors
(disaggregated prefill, offloading), sliding window / hybrid models, several KV cache groups.
The methods vLLM keeps for those features answer "nothing to do".

Ownership: a request's slots belong to it from `allocate_slots` until `free`; shared ones
belong to the tree, which the request locks meanwhile. Call timings go to an injected
`OpTimings` log, never to a global.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable

import numpy as np
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.kv_cache_interface import KVCacheConfig
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request, RequestStatus

from proxima.engine.faults import leak_per_free_from_env
from proxima.engine.token_cache import PrefixHit, TokenSlotCache
from proxima.metrics.catalog import ALLOCATOR_OPS, REFERENCE_BLOCK_SIZE

# Under "vllm." so the line lands in the server log with vLLM's own handlers and format.
logger = logging.getLogger(f"vllm.{__name__}")

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


class PrefixHitBlocks(SlotBlocks):
    """`get_computed_blocks`' answer: the hit's slots, and the hit itself for `allocate_slots`."""

    def __init__(self, hit: PrefixHit) -> None:
        super().__init__(hit.slots)
        self.hit = hit


_NO_SLOTS = np.empty(0, dtype=np.int32)


class SlotKVCacheManager:
    """Drop-in for vllm.v1.core.kv_cache_manager.KVCacheManager (same constructor keywords).

    `prefix_caching` is Proxima's own copy of vLLM's `--enable-prefix-caching`: the scheduler
    clears vLLM's flag afterwards so the engine does not hash every token for a block cache that
    does not exist, and passes the user's choice here.
    """

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
        prefix_caching: bool | None = None,
        exact_figures: bool = True,
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
        caching = enable_caching if prefix_caching is None else prefix_caching
        # vLLM reads `enable_caching` to decide whether to hash blocks: there are none to hash.
        self.enable_caching = False
        self.enable_kv_cache_events = False
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.cache = TokenSlotCache(
            kv_cache_config.num_blocks, caching=caching, reference_block=REFERENCE_BLOCK_SIZE,
            check_invariants=os.environ.get(CHECK_ENV) == "1", keep_duplicates=not exact_figures,
        )
        self.allocator = self.cache.allocator
        self.table = self.cache.table
        # False: what vLLM reports to clients of a request's prefix hit (its hit counters, the usage
        # block's cached_tokens) is counted in whole reference blocks, as a block cache would.
        self.exact_figures = exact_figures
        self.watermark_slots = int(watermark * kv_cache_config.num_blocks)
        self.timings = timings
        leak = leak_per_free_from_env()
        self.num_leaked_slots = 0
        if leak:  # a test-only fault: the hot path below stays free of it otherwise
            self._leak_per_free = leak
            self.free = self._free_and_leak
        self.empty_kv_cache_blocks = SlotBlocks(_NO_SLOTS)
        # vLLM reaches for these only with KV connectors, which Proxima refuses.
        self.block_pool = None
        self.coordinator = None

    @property
    def prefix_caching(self) -> bool:
        return self.cache.caching

    # -- admission and allocation -------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Share of slots live requests reference (cached, unreferenced slots count as free):
        vllm:kv_cache_usage_perc. Tree slots in whole blocks unless exact (kv_sources.py)."""
        cache = self.cache
        if self.exact_figures:
            return cache.num_referenced / cache.num_slots
        return min(1.0, cache.num_referenced_in_blocks / cache.num_slots)

    def disclosed(self, num_tokens: int) -> int:
        """A count of prefix-hit tokens as clients may read it: whole reference blocks unless exact."""
        return num_tokens if self.exact_figures else num_tokens - num_tokens % REFERENCE_BLOCK_SIZE

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int, int]:
        """The longest cached prefix of the request's tokens, at most all but the last one."""
        if not self.cache.caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0, 0
        namespace = _namespace(request)
        limit = min(request.num_tokens - 1, _cacheable_length(request))
        hit = None
        if namespace is not None and limit > 0:
            tokens = np.asarray(request.all_token_ids[:limit], dtype=np.int64)
            hit = self.cache.lookup(namespace, tokens)
        num_hit = hit.num_tokens if hit is not None else 0
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.record(num_tokens=request.num_tokens, num_hits=self.disclosed(num_hit),
                                           preempted=request.num_preemptions > 0)
        if hit is None:
            return self.empty_kv_cache_blocks, 0, 0
        return PrefixHitBlocks(hit), num_hit, 0

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
        cache = self.cache
        request_id = request.request_id
        hit = new_computed_blocks.hit if isinstance(new_computed_blocks, PrefixHitBlocks) else None
        num_computed = min(
            request.num_computed_tokens + num_new_computed_tokens + num_external_computed_tokens,
            self.max_model_len,
        )
        reserve = reserved_blocks
        if has_scheduled_reqs and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            reserve += self.watermark_slots
        must_fit = min(request.num_tokens, self.max_model_len) if full_sequence_must_fit else 0
        num_needed = min(num_computed + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        new = request_id not in self.table
        namespace = _namespace(request) if new and cache.caching else None
        slots = cache.allocate(request_id, num_needed, hit, reserve, namespace, must_fit)
        if slots is None:
            return None
        if cache.caching and not delay_cache_blocks and num_computed < request.num_prompt_tokens:
            # Prompt tokens join the cache as soon as they are scheduled (vLLM caches a block
            # once allocated for computation); generated ones when the request lets go.
            cache.cache(request_id, request.all_token_ids,
                        min(num_computed + num_new_tokens, request.num_prompt_tokens,
                            _cacheable_length(request)))
        if self.timings is not None:
            self.timings.allocate.append(time.perf_counter() - start)
        return SlotBlocks(slots) if slots.size else self.empty_kv_cache_blocks

    def free(self, request: Request) -> None:
        start = time.perf_counter()
        num_computed = min(request.num_computed_tokens, request.num_tokens,
                           _cacheable_length(request))
        self.cache.release(request.request_id, request.all_token_ids, num_computed)
        if self.timings is not None:
            self.timings.free.append(time.perf_counter() - start)

    def _free_and_leak(self, request: Request) -> None:
        """`free`, then lose slots on purpose (PROXIMA_FAULT_LEAK_SLOTS, tests of the leak probe)."""
        held = request.request_id in self.table
        SlotKVCacheManager.free(self, request)
        if held:
            leaked = self.allocator.allocate(min(self._leak_per_free, self.allocator.num_free))
            self.num_leaked_slots += 0 if leaked is None else leaked.size

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

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request the cache holds now (vLLM reports the growth as "cache creation")."""
        if self.exact_figures:
            return self.cache.num_in_tree(request.request_id)
        # A block cache counts every full block the request computed, its duplicates of blocks
        # already cached too; the tree holds one copy, and which tokens it already held is not
        # for clients to learn.
        if not self.cache.caching or _namespace(request) is None:
            return 0
        computed = min(request.num_computed_tokens, request.num_tokens, _cacheable_length(request))
        return self.disclosed(computed)

    # -- prefix cache control -----------------------------------------------------------------

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """vLLM's async scheduler calls this after every step of every running request. Only
        prompt tokens join the tree while a request runs (generated ones at release, as one run):
        a decode step returns at the first test, and no node is ever made per token."""
        num_tokens = min(num_computed_tokens, request.num_prompt_tokens)
        if not self.cache.caching or num_tokens <= self.cache.num_in_tree(request.request_id):
            return
        self.cache.cache(request.request_id, request.all_token_ids,
                         min(num_tokens, _cacheable_length(request)))

    def reset_prefix_cache(self) -> bool:
        if not self.cache.reset():
            logger.warning("Proxima: prefix cache not reset: %d requests still hold KV slots",
                           len(self.table))
            return False
        if self.log_stats:
            assert self.prefix_cache_stats is not None
            self.prefix_cache_stats.reset = True
        return True

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.cache.evict_slots(block_ids)

    # -- features Proxima refuses at start-up: nothing to do ---------------------------------

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [0]  # cascade attention is off for Proxima's backend

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


def _namespace(request: Request) -> Hashable | None:
    """Which cache the request may share: None when its KV must never be shared."""
    if request.prompt_embeds is not None:
        return None  # the token ids of embedded prompts do not say what was computed
    lora = request.lora_request.lora_int_id if request.lora_request is not None else 0
    return (lora, request.cache_salt)


def _cacheable_length(request: Request) -> int:
    """Tokens that depend on the token ids alone: up to the first multimodal placeholder."""
    if not request.mm_features:
        return request.num_tokens
    return min(f.mm_position.offset for f in request.mm_features)
