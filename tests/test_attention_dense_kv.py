"""Dense-tile KV reads (issue 18, `TileConfig.dense_kv`): a program whose slots are one ascending
run reads K/V through tensor descriptors (TMA on Hopper) instead of the per-token gather. The
choice is made on the GPU per program, so every table shape must give the torch reference's
result: all-contiguous, all-fragmented, mixed, runs that cross KV tile boundaries, a break on a
tile boundary, a run that ends at the cache's last slot, garbage (NaN) in the rows after a run.
A path test reads the descriptors from a different cache than the gather, to tell which path
each program took (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

from tests.attention_cases import (  # first: sets TRITON_INTERPRET on CPU-only machines
    DEVICE,
    INTERPRETER_WARNINGS,
    Batch,
    make_batch,
    triton_attention_or_skip,
)

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402

from proxima.engine.attention import planning  # noqa: E402
from proxima.engine.attention.planning import TileConfig  # noqa: E402
from proxima.engine.attention.reference import slot_attention_torch  # noqa: E402
from tests.test_attention_kernels import assert_rows  # noqa: E402

pytestmark = INTERPRETER_WARNINGS

DENSE = TileConfig(block_m=16, block_n=16, dense_kv=True)
DENSE_MIXED = TileConfig(block_m=32, block_n=16, short_block_m=16, short_block_n=32, dense_kv=True)
# (queries, context length): a prefill, a chunk over context, decodes, a request with no queries
REQUESTS = [(37, 37), (20, 53), (1, 40), (1, 17), (0, 9), (29, 29)]


@pytest.fixture(scope="module")
def kernels():
    return triton_attention_or_skip()


def _batch(table: str, heads: tuple[int, int], dtype: torch.dtype, seed: int) -> Batch:
    b = make_batch(REQUESTS, *heads, 32, fragmented=table == "all-fragmented", seed=seed, dtype=dtype)
    slots = b.slot_table.cpu()
    num_slots = b.k_cache.shape[0]
    if table == "mixed":  # one request breaks its run inside a tile, one is scattered
        row = slots[0, :37].clone()
        slots[0, 20], slots[0, 21] = row[21], row[20]
        slots[1, :53] = slots[1, :53][torch.randperm(53, generator=torch.Generator().manual_seed(seed))]
    elif table == "tile-boundary-break":  # two runs meeting exactly at a 16-position KV tile edge
        slots[1, 32:53] = torch.arange(num_slots - 21, num_slots, dtype=torch.int32)
    elif table == "run-to-cache-end":  # TMA reads past the last slot: zero rows, masked
        slots[5, :29] = torch.arange(num_slots - 29, num_slots, dtype=torch.int32)
    elif table == "nan-after-runs":  # spare slots past each run hold NaN: never let into a sum
        used = torch.zeros(num_slots, dtype=torch.bool)
        for r, (_, seq_len) in enumerate(REQUESTS):
            used[slots[r, :seq_len].long()] = True
        b.k_cache[~used.to(DEVICE)] = float("nan")
        b.v_cache[~used.to(DEVICE)] = float("nan")
    else:
        assert table in ("all-contiguous", "all-fragmented"), table
    b.slot_table = slots.to(DEVICE)
    return b


@pytest.mark.parametrize("table", ["all-contiguous", "all-fragmented", "mixed", "tile-boundary-break",
                                   "run-to-cache-end", "nan-after-runs"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)], ids=["gqa2", "mha"])
@pytest.mark.parametrize("plan", ["dense", "dense-mixed"])
def test_dense_reads_match_torch_on_every_table(kernels, monkeypatch, table: str, heads, plan: str) -> None:
    monkeypatch.setattr(planning, "choose_tiles", lambda *a: DENSE if plan == "dense" else DENSE_MIXED)
    b = _batch(table, heads, torch.float16, seed=len(table) + heads[0])
    expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))))
    kernels.slot_attention_triton(*b.args(), max_query_len=37, max_seq_len=53)
    assert_rows(b.output, expected.cpu(), b.num_queries, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("num_splits", [2, 5])
def test_dense_reads_under_split_kv_match_torch(kernels, monkeypatch, num_splits: int) -> None:
    # Each split checks and reads its own range: one range may be a run where another is not.
    monkeypatch.setattr(planning, "choose_tiles", lambda *a: DENSE)
    monkeypatch.setattr(planning, "choose_num_splits", lambda *a: num_splits)
    b = _batch("mixed", (4, 2), torch.float16, seed=7)
    expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))))
    kernels.slot_attention_triton(*b.args())
    assert_rows(b.output, expected.cpu(), b.num_queries, atol=2e-3, rtol=2e-3)


def _launch_with_other_descriptors(kernels, b: Batch, tiles: TileConfig, k_other, v_other) -> None:
    """The call's launch, with the descriptors built over other caches than the gather reads."""
    plan = kernels._launch_plan(b.query, b.k_cache, b.v_cache, b.slot_table, b.query_start_loc, b.seq_lens,
                                b.scale, b.output, b.query.shape[0], tiles, 1)
    ((launch, grid, args, key, options),) = plan
    swapped = kernels.kv_descriptors(k_other, v_other, tiles.block_n, b.query.shape[2])
    first = next(i for i, a in enumerate(args) if type(a).__name__ == "TensorDescriptor")
    args = (*args[:first], *swapped, *args[first + 2:])
    launch(grid, args, ("other descriptors", key), **options)


def test_each_program_reads_dense_exactly_where_its_slots_are_one_run(kernels) -> None:
    # Requests 0, 2, 4 contiguous; 1 and 3 break their run between positions 0 and 1, which every
    # program of theirs reads. The descriptors see V negated: dense rows come out negated.
    b = _batch("all-contiguous", (4, 2), torch.float16, seed=3)
    slots = b.slot_table.cpu()
    for r in (1, 3):
        slots[r, 0], slots[r, 1] = slots[r, 1].item(), slots[r, 0].item()
    b.slot_table = slots.to(DEVICE)
    _launch_with_other_descriptors(kernels, b, DENSE, b.k_cache, -b.v_cache)
    expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan")))).cpu()
    starts = b.query_start_loc.cpu().tolist()
    for r, (q_len, _) in enumerate(REQUESTS):
        rows = slice(starts[r], starts[r] + q_len)
        sign = -1.0 if r in (0, 2, 4, 5) else 1.0
        torch.testing.assert_close(b.output[rows].cpu().float(), sign * expected[rows].float(),
                                   atol=2e-3, rtol=2e-3, msg=f"request {r}")


def test_caches_that_descriptors_cannot_read_take_the_gather(kernels, monkeypatch) -> None:
    # fp32 storage and an odd head size (padded in the kernel) are not dense-eligible: the planned
    # flag is dropped on the host and results stay the reference's.
    monkeypatch.setattr(planning, "choose_tiles", lambda *a: DENSE)
    for dtype, head_size in ((torch.float32, 32), (torch.float16, 48)):
        b = make_batch(REQUESTS, 4, 2, head_size, fragmented=False, seed=head_size, dtype=dtype)
        assert not kernels.dense_kv_ok(b.query, b.k_cache, b.v_cache, head_size)
        expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))))
        kernels.slot_attention_triton(*b.args())
        assert_rows(b.output, expected.cpu(), b.num_queries, atol=2e-3, rtol=2e-3)
