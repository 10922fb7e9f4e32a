"""How often the KV tiles attention reads are one ascending run of slots (measurement only).

Layer: tools; pure numpy but for `ContextTiles`, which reads an in-process engine's slot table.
A dense-tile kernel path (attention/triton_dense_kv.py) pays only where tiles are contiguous;
scripts/bench_capacity.py and scripts/gpu/e2e.py count how often they are, step by step.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from proxima.engine.slot_table import RequestSlotTable
from proxima.metrics.sink import SchedulerStep


def contiguous_tiles(slots: np.ndarray, tile: int) -> tuple[int, int]:
    """(contiguous, all) KV tiles of one request's slot list, tiles of `tile` positions.

    Tile t holds positions [t*tile, (t+1)*tile), the last one clipped to the request's length,
    as the attention kernels step through a request's context. It is contiguous when its slots
    ascend by one, so that it could be read as one dense block of the cache rather than gathered
    token by token; how often that holds decides whether a dense-tile kernel path pays.
    """
    if tile < 1:
        raise ValueError(f"tile must be at least 1 position, got {tile}")
    n = slots.size
    if n == 0:
        return 0, 0
    breaks = np.flatnonzero(np.diff(slots.astype(np.int64)) != 1)  # between positions i and i+1
    inside = breaks[breaks % tile != tile - 1]  # a break at a tile boundary splits no tile
    num_tiles = -(-n // tile)
    return num_tiles - np.unique(inside // tile).size, num_tiles


class DenseTileTally:
    """Contiguous KV tiles among the contexts attention reads, summed over a run's steps, per
    tile width."""

    def __init__(self, name: str = "dense_tiles", tiles: tuple[int, ...] = (64, 128)) -> None:
        self.name = name
        # 64: the KV width of the prefill tiles, 128: that of the decode tiles
        self.counts = {tile: [0, 0] for tile in tiles}

    def add(self, table: RequestSlotTable, request_ids: Iterable[str]) -> None:
        contexts = [table.slots_of(request_id) for request_id in request_ids]
        for tile, counts in self.counts.items():
            for slots in contexts:
                dense, total = contiguous_tiles(slots, tile)
                counts[0] += dense
                counts[1] += total

    def shares(self) -> dict[str, float]:
        """{"<name>_64": share, ...}, for the widths that saw any tile."""
        return {f"{self.name}_{tile}": dense / total for tile, (dense, total) in self.counts.items() if total}


class ContextTiles:
    """A step listener (`Engine.listening`) of an engine with token slots: each step, the
    contiguous tiles of every running request's context (each step reads them all) and of the
    contexts being prefilled (more than one token scheduled). It reads slot lists, milliseconds a
    step on a large batch: keep it out of timed runs."""

    def __init__(self, engine) -> None:
        self._scheduler = engine.scheduler
        self._table = engine.kv_manager.table
        self.running = DenseTileTally()
        self.prefilled = DenseTileTally("prefill_dense_tiles")

    def __call__(self, step: SchedulerStep) -> None:
        self.running.add(self._table, (r.request_id for r in self._scheduler.running))
        self.prefilled.add(self._table, (rid for rid, n in step.num_scheduled_tokens.items() if n > 1))

    def shares(self) -> dict[str, float]:
        return self.running.shares() | self.prefilled.shares()
