"""Per-request slot lists: which physical slot holds each token position of each request.

Layer: between the allocator (slot numbers) and vLLM's manager (requests). Pure numpy.

Each request owns one growable int32 array (capacity doubles, so appends are amortised O(1)
per token with no per-token objects). Position p of request r lives in slot `slots_of(r)[p]`;
that row is what the worker's block table holds when the block size is 1.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from proxima.engine.slot_allocator import SLOT_DTYPE

_MIN_CAPACITY = 64


class RequestSlotTable:
    def __init__(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self._lengths: dict[str, int] = {}
        self._num_held = 0

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._lengths

    def __len__(self) -> int:
        return len(self._lengths)

    @property
    def num_slots_held(self) -> int:
        return self._num_held

    def num_slots(self, request_id: str) -> int:
        return self._lengths.get(request_id, 0)

    def slots_of(self, request_id: str) -> np.ndarray:
        """The request's slots in token order (a view: do not keep it across appends)."""
        n = self._lengths.get(request_id, 0)
        if n == 0:
            return np.empty(0, dtype=SLOT_DTYPE)
        return self._buffers[request_id][:n]

    def append(self, request_id: str, slots: np.ndarray) -> None:
        n_new = slots.size
        if n_new == 0:
            return
        n = self._lengths.get(request_id, 0)
        buf = self._buffers.get(request_id)
        if buf is None or n + n_new > buf.size:
            grown = np.empty(max(_MIN_CAPACITY, 2 * (n + n_new)), dtype=SLOT_DTYPE)
            if buf is not None:
                grown[:n] = buf[:n]
            buf = self._buffers[request_id] = grown
        buf[n : n + n_new] = slots
        self._lengths[request_id] = n + n_new
        self._num_held += n_new

    def pop(self, request_id: str) -> np.ndarray:
        """Forget the request and return (a copy of) the slots it held, in token order."""
        n = self._lengths.pop(request_id, 0)
        buf = self._buffers.pop(request_id, None)
        self._num_held -= n
        if buf is None:
            return np.empty(0, dtype=SLOT_DTYPE)
        return buf[:n].copy()

    def request_ids(self) -> list[str]:
        return list(self._lengths)

    def lengths(self) -> np.ndarray:
        return np.fromiter(self._lengths.values(), dtype=np.int64, count=len(self._lengths))


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
    """Contiguous KV tiles among the contexts attention reads, summed over a run's steps: the
    capacity and end-to-end benchmarks add the running requests of every step (each step reads
    every running request's whole context), per tile width."""

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
