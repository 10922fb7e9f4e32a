"""Token-granular KV slot allocator: any free slot serves any request.

Layer: the bottom of the engine. It knows slot numbers only: no requests, no vLLM, no metrics.

Representation (why): a slot is one token's K/V row in every layer. The free slots live in one
int32 array used as a LIFO stack (`_free_stack[:_num_free]`), and occupancy in one bool array.
So a 1M-slot cache costs 9 bytes per slot (4 of them scratch for the duplicate check) and
initialises with three numpy calls; allocate and free are O(n) vectorised copies with no
per-token Python objects. LIFO order means a run of slots freed together (a finished request's,
pushed back in reverse) is handed out again as the same ascending run, so the next request reads
K/V from contiguous rows. Each slot is a whole row of Hkv x D values, so even a scattered slot
list gives coalesced reads row by row.

Error contract: out of capacity is not an error (`allocate` returns None); freeing a slot that
is not in use, is out of range, or appears twice in one call is the caller's bug and raises
ValueError naming the slots, before anything changes (a bad free loses nothing). `check_held`
runs the same checks without freeing, for callers that must validate before changing their own
state. The duplicate check stamps each slot with its position in the call and reads the stamps
back (two fancy-index passes and a 4-byte scratch entry per slot): a slot given twice reads
another position's stamp (scripts/bench_host_path.py measures its cost).

Invariant checks (every slot either free or used, never both, counts consistent) run after
each operation when `check_invariants` is set (PROXIMA_CHECK_INVARIANTS=1 in the engine).
"""

from __future__ import annotations

import numpy as np

SLOT_DTYPE = np.int32


class SlotAllocator:
    def __init__(self, num_slots: int, check_invariants: bool = False) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        if num_slots > np.iinfo(SLOT_DTYPE).max:
            raise ValueError(f"num_slots {num_slots} exceeds the int32 slot index range")
        self._num_slots = num_slots
        # Descending, so the first pops from the top of the stack yield 0, 1, 2, ...
        self._free_stack = np.arange(num_slots - 1, -1, -1, dtype=SLOT_DTYPE)
        self._num_free = num_slots
        self._in_use = np.zeros(num_slots, dtype=np.bool_)
        self._stamp = np.zeros(num_slots, dtype=SLOT_DTYPE)  # scratch for the duplicate check
        self.check_invariants = check_invariants

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self._num_slots - self._num_free

    @property
    def in_use(self) -> np.ndarray:
        """Read-only view of per-slot occupancy."""
        view = self._in_use.view()
        view.flags.writeable = False
        return view

    def allocate(self, num_tokens: int) -> np.ndarray | None:
        """Hand out `num_tokens` free slots (ascending where they were freed together).

        Returns None, changing nothing, when fewer are free.
        """
        if num_tokens < 0:
            raise ValueError(f"cannot allocate a negative number of slots ({num_tokens})")
        if num_tokens > self._num_free:
            return None
        top = self._num_free
        if num_tokens == 1:  # every decode step, once per running request: skip the fancy indexing
            slots = self._free_stack[top - 1 : top].copy()
            self._in_use[slots[0]] = True
        else:
            slots = self._free_stack[top - num_tokens : top][::-1].copy()
            self._in_use[slots] = True
        self._num_free = top - num_tokens
        if self.check_invariants:
            self.assert_consistent()
        return slots

    def check_held(self, slots: np.ndarray) -> np.ndarray:
        """Raise ValueError (changing nothing) unless every slot is in use and given once."""
        slots = np.asarray(slots, dtype=SLOT_DTYPE)
        n = slots.size
        if n == 0:
            return slots
        if slots.min() < 0 or slots.max() >= self._num_slots:
            raise ValueError(f"slots out of range [0, {self._num_slots}): {_preview(slots)}")
        if not self._in_use[slots].all():
            bad = slots[~self._in_use[slots]]
            raise ValueError(f"double free: slots not in use {_preview(bad)}")
        if n > 1:
            order = np.arange(n, dtype=SLOT_DTYPE)
            self._stamp[slots] = order
            repeated = self._stamp[slots] != order
            if repeated.any():
                raise ValueError(f"slots freed twice in one call: {_preview(slots[repeated])}")
        return slots

    def free(self, slots: np.ndarray) -> None:
        """Return slots to the pool. Raises ValueError (and changes nothing) on a bad free."""
        slots = self.check_held(slots)
        n = slots.size
        if n == 0:
            return
        self._in_use[slots] = False
        top = self._num_free
        # Reversed, so the next allocate pops them back in their original order.
        self._free_stack[top : top + n] = slots[::-1]
        self._num_free = top + n
        if self.check_invariants:
            self.assert_consistent()

    def assert_consistent(self) -> None:
        free = self._free_stack[: self._num_free]
        if int(self._in_use.sum()) != self.num_used:
            raise AssertionError("in-use count disagrees with the free stack")
        if self._in_use[free].any():
            raise AssertionError(f"slots both free and in use: {_preview(free[self._in_use[free]])}")
        if np.unique(free).size != free.size:
            raise AssertionError("a slot appears twice in the free stack")


def _preview(slots: np.ndarray, limit: int = 8) -> str:
    head = ", ".join(str(int(s)) for s in slots[:limit])
    more = f", ... ({slots.size} in all)" if slots.size > limit else ""
    return f"[{head}{more}]"
