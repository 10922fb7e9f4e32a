"""What the KV cache holds at one instant, and what block-granular allocation would waste.

Layer: pure arithmetic over numpy arrays (no vLLM, no Prometheus), shared by the slot allocator
and the stock block allocator so that both are measured by the same definitions:

  live tokens           tokens whose K/V live requests hold (computed, or being computed this
                        step); a slot that k requests share through the prefix cache counts once
  allocated slots       slots live requests reference, each once however many share it (cached
                        slots that no request references are counted apart, as `slots_cached`)
  fragmentation ratio   (allocated - live) / allocated; 0 when nothing is allocated
  block fragmentation   the same, had each request been given whole blocks of `reference_block`
                        (with a block-granular prefix cache sharing the full blocks it could)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class PrefixCacheTotals:
    """Cumulative prefix-cache counts since the engine started (exported as counters)."""

    hit_tokens: int = 0
    hit_tokens_beyond_blocks: int = 0  # hits a `reference_block`-token block cache would miss
    evicted_tokens: int = 0

    def totals(self) -> tuple[int, int, int]:
        """In the order of `catalog.PREFIX_COUNTERS`."""
        return self.hit_tokens, self.hit_tokens_beyond_blocks, self.evicted_tokens


@dataclass(frozen=True, slots=True)
class KVStats:
    allocator: str
    granularity: int
    slots_total: int
    slots_used: int
    slots_cached: int
    live_tokens: int
    num_requests: int
    reference_block: int
    reference_block_slots: int
    occupancy: tuple[float, ...]
    largest_free_run: int
    prefix: PrefixCacheTotals = PrefixCacheTotals()

    @property
    def slots_free(self) -> int:
        return self.slots_total - self.slots_used

    @property
    def token_usage(self) -> float:
        return self.live_tokens / self.slots_total if self.slots_total else 0.0

    @property
    def block_usage(self) -> float:
        return self.reference_block_slots / self.slots_total if self.slots_total else 0.0

    @property
    def fragmentation(self) -> float:
        return _waste(self.slots_used, self.live_tokens)

    @property
    def block_fragmentation(self) -> float:
        return _waste(self.reference_block_slots, self.live_tokens)


def _waste(allocated: int, live: int) -> float:
    return max(0.0, (allocated - live) / allocated) if allocated > 0 else 0.0


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
