"""Per-request slot lists: which physical slot holds each token position of each request.

Layer: between the allocator (slot numbers) and vLLM's manager (requests). Pure numpy.

Each request owns one growable int32 array (capacity doubles, so appends are amortised O(1)
per token with no per-token objects). Position p of request r lives in slot `slots_of(r)[p]`;
that row is what the worker's block table holds when the block size is 1.
"""

from __future__ import annotations

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

    def num_slots_of(self, request_id: str) -> int:
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

