"""What the KV cache holds at one instant: the figures the engine publishes to every sink.

Layer: metrics (plain data, no numpy, no vLLM, no Prometheus). The type lives here, beside the
catalog and the exporters that read it, so that the metrics package never imports the engine;
the engine computes it (engine/kv_sources.py, one source per allocator) and hands it to the
sinks. Both allocators are measured by the same definitions:

  live tokens           tokens whose K/V live requests hold (computed, or being computed this
                        step); a slot that k requests share through the prefix cache counts once
  allocated slots       slots live requests reference, each once however many share it (cached
                        slots that no request references are counted apart, as `slots_cached`)
  fragmentation ratio   (allocated - live) / allocated; 0 when nothing is allocated
  block fragmentation   the same, had each request been given whole blocks of `reference_block`
                        (with a block-granular prefix cache sharing the full blocks it could)

Under block-granular disclosure (the default; `exact` False) every figure that depends on what
other requests cached is computed so that it depends on shared lengths only to the whole
`reference_block`: see `proxima.engine.kv_sources` and docs/security.md. The figures that cannot
be (the physical occupancy map, the largest free run, hits beyond whole blocks) are None then,
and exporters publish nothing for them.

Each exported figure names its attribute here in its catalog entry (`MetricSpec.stat`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefixCacheTotals:
    """Cumulative prefix-cache counts since the engine started (exported as counters)."""

    hit_tokens: int = 0
    hit_tokens_beyond_blocks: int | None = 0  # hits a `reference_block`-token block cache would miss
    evicted_tokens: int = 0


@dataclass(frozen=True, slots=True)
class KVStats:
    allocator: str
    granularity: int
    slots_total: int
    slots_used: int
    slots_cached: int
    live_tokens: int
    requests_holding_slots: int
    reference_block: int
    reference_block_slots: int
    occupancy: tuple[float, ...] | None
    largest_free_run: int | None
    prefix: PrefixCacheTotals = PrefixCacheTotals()
    exact: bool = True  # False: block-granular disclosure (module docstring)
    # Cached slots per segment of `occupancy` (None where not disclosed, or not computed).
    occupancy_cached: tuple[float, ...] | None = None

    @property
    def slots_free(self) -> int:
        return self.slots_total - self.slots_used

    @property
    def token_usage(self) -> float:
        return ratio(self.live_tokens, self.slots_total)

    @property
    def block_usage(self) -> float:
        return ratio(self.reference_block_slots, self.slots_total)

    @property
    def fragmentation(self) -> float:
        return waste(self.slots_used, self.live_tokens)

    @property
    def block_fragmentation(self) -> float:
        return waste(self.reference_block_slots, self.live_tokens)


def ratio(part: float, whole: float) -> float:
    """part / whole; 0 for an empty whole (a cache that has not reported its size yet)."""
    return part / whole if whole else 0.0


def waste(allocated: float, live: float) -> float:
    """Share of `allocated` that holds no live token: (allocated - live) / allocated, at least 0."""
    return max(0.0, (allocated - live) / allocated) if allocated > 0 else 0.0
