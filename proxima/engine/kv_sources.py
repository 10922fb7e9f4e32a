"""Where the scheduler's KV figures come from: one small source per allocator.

Layer: engine (reads an allocator's own state; no exporter, no Prometheus). The scheduler hooks
vLLM's scheduling and calls `collect(running)` at each telemetry publish; it never looks inside
a KV manager itself. Two sources, one per `--proxima-allocator`:

  SlotKVSource       Proxima's token slots: counts the slot cache keeps as it goes (O(1)), plus
                     the prefix tree's shared-slot totals
  BlockPoolKVSource  vLLM's own block pool, read in slot units (block x block size); vLLM keeps
                     no counts of what its prefix cache shares, so that is counted by a pass over
                     the blocks, with the other slow figures

Both compute live tokens from the running requests the same way, and both refresh the figures
that scan every slot (occupancy map, largest free run; the stock pool's sharing counts) at most
every `SLOW_STATS_INTERVAL_S` while busy, and on every idle step, so that values read at rest are
exact. What each figure means is defined once, in `proxima.metrics.kv_stats`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from proxima.engine.kv_manager import OpTimings, SlotKVCacheManager
from proxima.metrics import catalog
from proxima.metrics.kv_stats import KVStats, PrefixCacheTotals

# Occupancy map and largest free run scan every slot: refresh them at most this often.
SLOW_STATS_INTERVAL_S = 0.5


class KVSource(Protocol):
    allocator: str  # the `--proxima-allocator` name the figures are labelled with
    granularity: int  # tokens per allocation unit
    prefix_caching: bool

    def collect(self, running: Sequence) -> KVStats:
        """The KV state now, for these running requests (vLLM's `Request` objects)."""
        ...

    def slots_held(self, request_id: str) -> int:
        """Slots the request holds now (its KV span's peak is the most of these)."""
        ...


class _SlowFigures:
    """The figures that scan every slot, as of their last refresh."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._refreshed_at = 0.0
        self.occupancy: tuple[float, ...] = ()
        self.occupancy_cached: tuple[float, ...] = ()
        self.largest_free_run = 0

    def due(self, busy: bool) -> bool:
        """True (and the refresh counted as done) when a refresh is due now."""
        now = self._clock()
        # Always refresh on an idle step: it is the last publish before the engine sleeps.
        if busy and now - self._refreshed_at < SLOW_STATS_INTERVAL_S:
            return False
        self._refreshed_at = now
        return True

    def scan(self, used: np.ndarray, cached: np.ndarray) -> None:
        """`used`: slots requests reference; `cached`: slots holding prefix entries no request
        references. Two maps, so an idle cache full of prefixes never reads as in use; the free
        run counts slots that are neither."""
        self.occupancy = downsample_occupancy(used, catalog.OCCUPANCY_SEGMENTS)
        self.occupancy_cached = downsample_occupancy(cached, catalog.OCCUPANCY_SEGMENTS)
        self.largest_free_run = largest_free_run(used | cached)


class SlotKVSource:
    """Proxima's slot cache: every count is kept by the cache itself.

    `exact` False (the default of `proxima serve`) publishes block-granular disclosure: a client
    who can read the figures must learn no more about other requests' cached tokens than a
    `reference_block`-token block cache would tell it. Where a request's prompt leaves a cached
    sequence is the exact shared length, so the prefix tree's slots are counted by the block
    boundaries they cross (`RadixTree.num_*_blocks`), hits in whole blocks, and the figures that
    count physical slots one by one (occupancy map, largest free run) are not disclosed. Slots a
    request holds privately are counted exactly: they do not depend on other requests. The
    allocator itself still shares every token. docs/security.md argues each figure.
    """

    granularity = 1

    def __init__(self, manager: SlotKVCacheManager, allocator: str, timings: OpTimings | None = None,
                 clock: Callable[[], float] = time.monotonic, exact: bool = True) -> None:
        self.allocator = allocator
        self.exact = exact
        self._mgr = manager
        self._slow = _SlowFigures(clock)
        # The manager times its allocate and free calls into the scheduler's log (None: untimed).
        manager.timings = timings

    @property
    def prefix_caching(self) -> bool:
        return self._mgr.prefix_caching

    def slots_held(self, request_id: str) -> int:
        return self._mgr.table.num_slots_of(request_id)

    def collect(self, running: Sequence) -> KVStats:
        cache, tree = self._mgr.cache, self._mgr.cache.tree
        live = live_tokens_per_request(running)
        counters = cache.counters
        # A slot k requests share counts once; so do the full blocks a 16-token block cache
        # would have shared for the same requests.
        live_tokens = int(live.sum()) - tree.shared_excess
        used, cached = cache.num_referenced, cache.num_cached
        figures = dict(
            allocator=self.allocator,
            granularity=self.granularity,
            slots_total=cache.num_slots,
            requests_holding_slots=len(self._mgr.table),
            reference_block=catalog.REFERENCE_BLOCK_SIZE,
            reference_block_slots=block_slots(live, catalog.REFERENCE_BLOCK_SIZE) - tree.shared_excess_blocks,
        )
        if not self.exact:
            # Slots allocated to tokens not yet computed (the waste) are each request's own.
            waste_slots = max(0, used - live_tokens)
            used = min(cache.num_slots, cache.num_referenced_in_blocks)
            return KVStats(
                **figures, slots_used=used, live_tokens=max(0, used - waste_slots),
                slots_cached=min(cache.num_slots - used, cache.num_cached_in_blocks),
                prefix=PrefixCacheTotals(counters.hit_tokens_in_blocks, None, counters.evicted_block_slots),
                occupancy=None, largest_free_run=None, exact=False,
            )
        if self._slow.due(busy=bool(running)):
            cached_mask = np.zeros(cache.num_slots, dtype=np.bool_)
            cached_mask[tree.cached_slots()] = True
            # The allocator holds every referenced or cached slot.
            self._slow.scan(self._mgr.allocator.in_use & ~cached_mask, cached_mask)
        return KVStats(
            **figures, slots_used=used, slots_cached=cached, live_tokens=live_tokens,
            prefix=PrefixCacheTotals(counters.hit_tokens, counters.hit_tokens_beyond_blocks,
                                     counters.evicted_tokens),
            occupancy=self._slow.occupancy,
            largest_free_run=self._slow.largest_free_run,
            occupancy_cached=self._slow.occupancy_cached,
        )


class BlockPoolKVSource:
    """vLLM's own block manager, observed and never changed (`--proxima-allocator block`).

    Reads vLLM 0.26's `KVCacheManager.block_pool` (`num_gpu_blocks`, `get_num_free_blocks()`,
    `blocks[i].ref_cnt` / `.block_hash`) and its first single-type manager's `req_to_blocks`;
    block 0 is vLLM's reserved null block and is never counted.
    """

    def __init__(self, manager, allocator: str, block_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.allocator = allocator
        self.granularity = block_size
        self._mgr = manager
        self._slow = _SlowFigures(clock)
        self._cached_slots = 0
        self._shared_slots = 0

    @property
    def prefix_caching(self) -> bool:
        return bool(self._mgr.enable_caching)

    def _req_to_blocks(self) -> dict:
        return self._mgr.coordinator.single_type_managers[0].req_to_blocks

    def slots_held(self, request_id: str) -> int:
        return len(self._req_to_blocks().get(request_id, ())) * self.granularity

    def collect(self, running: Sequence) -> KVStats:
        pool, b = self._mgr.block_pool, self.granularity
        num_blocks = pool.num_gpu_blocks - 1
        live = live_tokens_per_request(running)
        if self._slow.due(busy=bool(running)):
            used = np.fromiter((blk.ref_cnt > 0 for blk in pool.blocks[1:]), dtype=np.bool_, count=num_blocks)
            # A free block with a hash still holds a prefix-cache entry: cached, not free.
            cached = np.fromiter((self._mgr.enable_caching and blk.ref_cnt == 0 and blk.block_hash is not None
                                  for blk in pool.blocks[1:]), dtype=np.bool_, count=num_blocks)
            self._slow.scan(np.repeat(used, b), np.repeat(cached, b))
            self._cached_slots, self._shared_slots = self._count_sharing()
        # vLLM's prefix cache shares whole blocks: each shared block's tokens count once (as of
        # the last slow refresh, which every idle step makes).
        shared = self._shared_slots
        return KVStats(
            allocator=self.allocator,
            granularity=b,
            slots_total=num_blocks * b,
            slots_used=(num_blocks - pool.get_num_free_blocks()) * b,
            slots_cached=self._cached_slots,
            live_tokens=max(0, int(live.sum()) - shared),
            requests_holding_slots=len(self._req_to_blocks()),
            reference_block=catalog.REFERENCE_BLOCK_SIZE,
            reference_block_slots=max(0, block_slots(live, catalog.REFERENCE_BLOCK_SIZE) - shared),
            occupancy=self._slow.occupancy,
            largest_free_run=self._slow.largest_free_run,
            occupancy_cached=self._slow.occupancy_cached,
        )

    def _count_sharing(self) -> tuple[int, int]:
        """Free blocks that still hold a prefix-cache entry (reusable without recompute), and the
        slots requests share beyond the first holder of each block, both in slots."""
        if not self._mgr.enable_caching:
            return 0, 0
        cached = shared = 0
        for blk in self._mgr.block_pool.blocks[1:]:
            if blk.ref_cnt > 1:
                shared += blk.ref_cnt - 1
            elif blk.ref_cnt == 0 and blk.block_hash is not None:
                cached += 1
        return cached * self.granularity, shared * self.granularity


# -- arithmetic over per-request and per-slot arrays, shared by both sources -----------------

def live_tokens_per_request(running: Sequence) -> np.ndarray:
    return np.fromiter((r.num_computed_tokens for r in running), dtype=np.int64, count=len(running))


def block_slots(live_tokens_per_request: np.ndarray, block_size: int) -> int:
    """Slots that whole blocks of `block_size` would take for these requests."""
    if live_tokens_per_request.size == 0:
        return 0
    blocks = -(-live_tokens_per_request // block_size)
    return int(blocks.sum()) * block_size


def downsample_occupancy(in_use: np.ndarray, num_segments: int) -> tuple[float, ...]:
    """Fraction in use of each of `num_segments` equal ranges of a per-slot occupancy array."""
    n = in_use.size
    if n == 0:
        return ()
    num_segments = max(1, min(num_segments, n))
    edges = np.linspace(0, n, num_segments + 1).astype(np.int64)
    prefix = np.concatenate(([0], np.cumsum(in_use, dtype=np.int64)))
    used = prefix[edges[1:]] - prefix[edges[:-1]]
    return tuple((used / np.maximum(edges[1:] - edges[:-1], 1)).tolist())


def largest_free_run(in_use: np.ndarray) -> int:
    if in_use.size == 0 or in_use.all():
        return 0
    free = np.concatenate(([0], (~in_use).astype(np.int8), [0]))
    edges = np.flatnonzero(np.diff(free))
    return int((edges[1::2] - edges[::2]).max())
