"""SlotAllocator and RequestSlotTable on plain arrays: unit tests and a hypothesis state machine
checked against a trivial model allocator (a Python set of free slots)."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from proxima.engine import kv_sources
from proxima.engine.slot_allocator import SlotAllocator
from proxima.engine.slot_table import RequestSlotTable
from proxima.metrics.kv_stats import KVStats


def test_fresh_allocator_hands_out_ascending_contiguous_slots():
    alloc = SlotAllocator(10)
    assert alloc.allocate(4).tolist() == [0, 1, 2, 3]
    assert alloc.allocate(3).tolist() == [4, 5, 6]
    assert (alloc.num_used, alloc.num_free) == (7, 3)


def test_out_of_capacity_returns_none_and_changes_nothing():
    alloc = SlotAllocator(4)
    alloc.allocate(3)
    assert alloc.allocate(2) is None
    assert alloc.num_free == 1
    assert alloc.allocate(1).tolist() == [3]


def test_freed_run_comes_back_in_order_to_the_next_request():
    alloc = SlotAllocator(16)
    a = alloc.allocate(5)
    alloc.allocate(5)
    alloc.free(a)
    assert alloc.allocate(5).tolist() == a.tolist()


def test_any_freed_slot_serves_any_request():
    alloc = SlotAllocator(6)
    first = alloc.allocate(6)
    alloc.free(first[[1, 4]])  # two holes in the middle
    assert sorted(alloc.allocate(2).tolist()) == [1, 4]
    assert alloc.num_free == 0


@pytest.mark.parametrize("bad", [[99], [-1]])
def test_out_of_range_free_raises_and_loses_nothing(bad):
    alloc = SlotAllocator(8)
    held = alloc.allocate(4)
    with pytest.raises(ValueError, match="out of range"):
        alloc.free(np.array(bad))
    assert alloc.num_used == 4
    alloc.free(held)
    assert alloc.num_used == 0


def test_double_free_raises_naming_the_slots_and_changes_nothing():
    alloc = SlotAllocator(8, check_invariants=True)
    held = alloc.allocate(3)
    alloc.free(held[:1])
    with pytest.raises(ValueError, match=r"double free.*\[0\]"):
        alloc.free(held)
    assert alloc.num_used == 2  # the valid part of the bad call was not applied either
    alloc.free(held[1:])
    assert alloc.num_used == 0


def test_negative_and_zero_requests():
    alloc = SlotAllocator(4)
    assert alloc.allocate(0).size == 0
    with pytest.raises(ValueError):
        alloc.allocate(-1)
    with pytest.raises(ValueError):
        SlotAllocator(0)


def test_million_slots_cost_a_few_bytes_each():
    gc.collect()
    objects_before = len(gc.get_objects())
    alloc = SlotAllocator(1 << 20)
    slots = alloc.allocate(1 << 19)
    nbytes = alloc._free_stack.nbytes + alloc._in_use.nbytes
    assert nbytes == 5 * (1 << 20)  # int32 free stack + bool occupancy
    # No Python object per slot, allocated or free: the tracked-object count barely moves.
    assert len(gc.get_objects()) - objects_before < 100
    alloc.free(slots)


def test_slot_table_grows_and_pops_in_token_order():
    table = RequestSlotTable()
    table.append("a", np.arange(0, 50, dtype=np.int32))
    table.append("a", np.arange(100, 200, dtype=np.int32))
    table.append("b", np.array([7], dtype=np.int32))
    assert table.num_slots_of("a") == 150 and table.num_slots_held == 151
    assert table.slots_of("a")[48:52].tolist() == [48, 49, 100, 101]
    assert table.pop("a").tolist() == list(range(50)) + list(range(100, 200))
    assert "a" not in table and table.num_slots_held == 1
    assert table.pop("missing").size == 0


def test_kv_stats_fragmentation_and_block_arithmetic():
    live = np.array([1, 16, 17, 40])
    assert kv_sources.block_slots(live, 16) == (1 + 1 + 2 + 3) * 16
    stats = KVStats(
        allocator="token", granularity=1, slots_total=1000, slots_used=74, slots_cached=0,
        live_tokens=74, requests_holding_slots=4, reference_block=16,
        reference_block_slots=kv_sources.block_slots(live, 16), occupancy=(), largest_free_run=0,
    )
    assert stats.fragmentation == 0.0
    assert stats.block_fragmentation == pytest.approx((112 - 74) / 112)
    occ = np.zeros(8, dtype=bool)
    occ[[0, 1, 5]] = True
    assert kv_sources.downsample_occupancy(occ, 4) == (1.0, 0.0, 0.5, 0.0)
    assert kv_sources.largest_free_run(occ) == 3


def test_block_pool_maps_used_and_cached_blocks_apart():
    """vLLM's block pool observed on stand-ins: a free block that keeps its hash is cached, not free."""
    from types import SimpleNamespace as NS

    # Block 0 is vLLM's null block; then used, cached, free, used, free, free.
    blocks = [NS(ref_cnt=0, block_hash=None)] + [NS(ref_cnt=r, block_hash=h) for r, h in (
        (1, "a"), (0, "b"), (0, None), (2, "c"), (0, None), (0, None))]
    pool = NS(num_gpu_blocks=len(blocks), blocks=blocks, get_num_free_blocks=lambda: 4)
    manager = NS(block_pool=pool, enable_caching=True,
                 coordinator=NS(single_type_managers=[NS(req_to_blocks={"r": blocks[1:2]})]))
    stats = kv_sources.BlockPoolKVSource(manager, "block", block_size=4, clock=lambda: 10.0).collect([])
    per_slot = [float(x) for x in "100100" for _ in range(4)]  # 24 slots: one segment each
    assert stats.occupancy == tuple(per_slot) and stats.slots_cached == 4
    assert stats.occupancy_cached == tuple(float(x) for x in "010000" for _ in range(4))
    assert stats.largest_free_run == 2 * 4  # the last two blocks; the cached one breaks the first run


class AllocatorAgainstModel(RuleBasedStateMachine):
    """Random allocate/free sequences; the model is a set of free slots and a dict of holders."""

    NUM_SLOTS = 64

    def __init__(self) -> None:
        super().__init__()
        self.alloc = SlotAllocator(self.NUM_SLOTS, check_invariants=True)
        self.table = RequestSlotTable()
        self.model_free = set(range(self.NUM_SLOTS))
        self.model_held: dict[str, list[int]] = {}
        self.next_id = 0

    @rule(n=st.integers(min_value=0, max_value=80), existing=st.booleans())
    def allocate(self, n: int, existing: bool) -> None:
        if existing and self.model_held:
            rid = sorted(self.model_held)[0]
        else:
            rid, self.next_id = f"r{self.next_id}", self.next_id + 1
        slots = self.alloc.allocate(n)
        if n > len(self.model_free):
            assert slots is None
            return
        assert slots is not None and slots.size == n
        got = set(slots.tolist())
        assert len(got) == n, "a slot handed out twice in one allocation"
        assert got <= self.model_free, "a slot in use was handed out again"
        self.model_free -= got
        self.model_held.setdefault(rid, []).extend(slots.tolist())
        self.table.append(rid, slots)

    @precondition(lambda self: bool(self.model_held))
    @rule(data=st.data())
    def free_request(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model_held)))
        slots = self.table.pop(rid)
        assert slots.tolist() == self.model_held.pop(rid)
        self.alloc.free(slots)
        self.model_free |= set(slots.tolist())

    @precondition(lambda self: bool(self.model_held))
    @rule(data=st.data())
    def double_free_is_rejected(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.model_held)))
        free_slot = next(iter(self.model_free), None)
        if free_slot is None:
            return
        bad = np.array(self.model_held[rid][:1] + [free_slot], dtype=np.int32)
        try:
            self.alloc.free(bad)
        except ValueError:
            pass
        else:
            raise AssertionError("freeing a free slot was accepted")

    @invariant()
    def counts_consistent(self) -> None:
        assert self.alloc.num_free == len(self.model_free)
        assert self.alloc.num_used == sum(len(v) for v in self.model_held.values())
        assert self.table.num_slots_held == self.alloc.num_used
        assert set(np.flatnonzero(~self.alloc.in_use).tolist()) == self.model_free


TestAllocatorAgainstModel = AllocatorAgainstModel.TestCase
TestAllocatorAgainstModel.settings = settings(max_examples=150, stateful_step_count=40)
