"""Contiguity of KV tiles on plain slot lists (issue 18: how often a dense-tile read would apply).

The cases the issue names: all-contiguous, all-fragmented, mixed tiles, runs that cross tile
boundaries; and a property test against the definition, tile by tile.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxima.engine.slot_table import RequestSlotTable
from proxima.harness.tiles import DenseTileTally, contiguous_tiles


def _by_definition(slots: np.ndarray, tile: int) -> tuple[int, int]:
    chunks = [slots[i:i + tile] for i in range(0, slots.size, tile)]
    dense = sum(bool(np.array_equal(c, np.arange(c[0], c[0] + c.size))) for c in chunks)
    return dense, len(chunks)


def test_one_ascending_run_is_contiguous_in_every_tile_including_the_clipped_last():
    assert contiguous_tiles(np.arange(500, 500 + 130, dtype=np.int32), 64) == (3, 3)


def test_a_shuffled_list_has_no_contiguous_tile():
    slots = np.random.default_rng(0).permutation(4096)[:256].astype(np.int32)
    assert contiguous_tiles(slots, 64) == (0, 4)


def test_mixed_tiles_count_only_the_dense_ones():
    dense, gathered = np.arange(64), np.arange(64)[::-1] + 1000
    slots = np.concatenate([dense, gathered, dense + 7000]).astype(np.int32)
    assert contiguous_tiles(slots, 64) == (2, 3)


def test_a_break_on_a_tile_boundary_splits_no_tile_and_one_inside_splits_one():
    on_boundary = np.concatenate([np.arange(64), np.arange(9000, 9064)]).astype(np.int32)
    assert contiguous_tiles(on_boundary, 64) == (2, 2)
    inside = np.concatenate([np.arange(70), np.arange(9000, 9058)]).astype(np.int32)  # run crosses
    assert contiguous_tiles(inside, 64) == (1, 2)


def test_a_descending_step_or_a_repeat_is_a_break():
    assert contiguous_tiles(np.array([5, 6, 6, 7], dtype=np.int32), 4) == (0, 1)
    assert contiguous_tiles(np.array([5, 4], dtype=np.int32), 2) == (0, 1)


def test_no_slots_no_tiles_and_a_bad_tile_is_refused():
    assert contiguous_tiles(np.empty(0, dtype=np.int32), 64) == (0, 0)
    with pytest.raises(ValueError, match="tile must be at least 1"):
        contiguous_tiles(np.arange(4, dtype=np.int32), 0)


@given(st.lists(st.integers(0, 40), min_size=0, max_size=300), st.sampled_from([1, 2, 16, 64, 128]))
def test_matches_the_definition_tile_by_tile(steps, tile):
    # Mostly +1 steps (runs), with jumps: a jump of 1 continues a run, others break it.
    slots = np.cumsum([1 if s > 10 else s for s in steps]).astype(np.int32)
    assert contiguous_tiles(slots, tile) == _by_definition(slots, tile)


def test_the_tally_sums_every_width_over_the_requests_of_each_step():
    table = RequestSlotTable()
    table.append("a", np.arange(128, dtype=np.int32))  # 2 dense 64-tiles, 1 dense 128-tile
    table.append("b", np.arange(300, 172, -1, dtype=np.int32))  # 2 + 1 gathered tiles
    tally = DenseTileTally()  # named dense_tiles
    tally.add(table, (rid for rid in ("a", "b")))  # a generator, as the benchmarks pass
    tally.add(table, ["a"])
    assert tally.counts == {64: [4, 6], 128: [2, 3]}
    assert tally.shares() == {"dense_tiles_64": 4 / 6, "dense_tiles_128": 2 / 3}
    assert DenseTileTally().shares() == {}
