"""Split-KV (flash-decoding) path of ``slot_attention_triton`` against ``slot_attention_torch``.

Without CUDA the kernels run under the Triton interpreter: TRITON_INTERPRET is read when a kernel
is decorated, so it is set here before anything imports Triton (as in test_attention_kernels.py);
on a CUDA machine the same tests run the real kernels. The interpreter knows no SM count and so
never splits on its own: tests force a split count (and 16-token KV tiles, so a context of at
most 96 tokens spans up to 6 segments) by replacing ``choose_tiles`` / ``choose_num_splits``.
"""

from __future__ import annotations

import functools
import math

from tests.attention_cases import (  # first: sets TRITON_INTERPRET on CPU-only machines
    BACKEND_LAYOUT,
    DEVICE,
    INTERPRETER_WARNINGS,
    Batch,
    triton_attention_or_skip,
)

# isort: split
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from proxima.engine.attention import planning  # noqa: E402
from proxima.engine.attention.planning import (  # noqa: E402
    DECODE_KV_STAGE_BUDGET_BYTES,
    KV_STAGE_BUDGET_BYTES,
    TileConfig,
)
from proxima.engine.attention.reference import slot_attention_torch  # noqa: E402
from tests.attention_cases import make_batch as _make_batch

pytestmark = INTERPRETER_WARNINGS
KV_TILE = 16  # forced BLOCK_N: segments are whole tiles, so a 96-token context has 6 of them

# (q_len, seq_len): decodes over 6, 3, 1 and 1 tiles (the short ones leave segments empty once
# S > their tile count), a full prefill, chunked prefills over cached context (one with a tile
# boundary mid-chunk), a request with no queries mid-batch, and a padding request at the end.
MIXED = [(1, 96), (1, 40), (7, 7), (1, 9), (12, 70), (0, 6), (1, 1), (5, 21), (0, 0)]
DECODES = [(1, 96), (1, 9), (1, 50), (1, 1), (1, 17)]


# Fragmented slots in the backend's own layout (K|V side by side per head in one row).
make_batch = functools.partial(_make_batch, fragmented=True, layout=BACKEND_LAYOUT)


def expected_of(b: Batch, num_actual_tokens: int | None = None) -> torch.Tensor:
    out = torch.full_like(b.output, float("nan"))
    return slot_attention_torch(*b.args(out), num_actual_tokens=num_actual_tokens).float().cpu()


def assert_rows(out: torch.Tensor, expected: torch.Tensor, num_written: int, tol: float) -> None:
    """Rows below num_written match; every row from num_written on is still NaN (untouched)."""
    out = out.float().cpu()
    assert torch.isfinite(out[:num_written]).all()
    torch.testing.assert_close(out[:num_written], expected[:num_written], atol=tol, rtol=tol)
    assert torch.isnan(out[num_written:]).all()


def tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 1e-3


@pytest.fixture(scope="module")
def kernels():
    return triton_attention_or_skip()


@pytest.fixture
def force(kernels, monkeypatch: pytest.MonkeyPatch):
    """force(S): the next launches use S splits (1 = the unified kernel) over 16-token KV tiles.
    Records each launch's (num_programs, num_kv_tiles) in the returned list."""
    calls: list[tuple[int, int]] = []

    def apply(num_splits: int, small_tiles: bool = True) -> list[tuple[int, int]]:
        if small_tiles:
            def tiles(group, *rest):
                return TileConfig(block_m=max(16, 1 << (group - 1).bit_length()), block_n=KV_TILE)
            monkeypatch.setattr(planning, "choose_tiles", tiles)

        def splits(num_programs, num_kv_tiles, num_sms):
            calls.append((num_programs, num_kv_tiles))
            return num_splits
        monkeypatch.setattr(planning, "choose_num_splits", splits)
        return calls

    return apply


def run_split(kernels, b: Batch, **kwargs) -> torch.Tensor:
    out = kernels.slot_attention_triton(*b.args(), **kwargs)
    assert out is b.output
    return out


# ---------------------------------------------------------------------------------------------
# results: forced splits vs the torch path


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4, 5])
def test_forced_splits_match_torch_on_a_mixed_batch(kernels, force, num_splits: int) -> None:
    # S = 1 is the unified kernel (the launcher's routing); 2..5 cut the 6-tile decode into
    # uneven segments and leave empty segments for the 1-tile requests and the early prefill rows.
    force(num_splits)
    b = make_batch(MIXED, 4, 2, 32, seed=num_splits)
    run_split(kernels, b, max_query_len=12, max_seq_len=96)
    assert_rows(b.output, expected_of(b), b.num_queries, 1e-3)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_forced_splits_match_torch_with_a_mixed_plan(kernels, force, monkeypatch: pytest.MonkeyPatch,
                                                     num_splits: int) -> None:
    # Decodes take 16-row tiles over 32-token KV tiles, the rest 32-row tiles over 16-token ones:
    # each shape cuts its own KV range into the launch's one split count.
    force(num_splits)
    mixed = TileConfig(block_m=32, block_n=KV_TILE, short_block_m=16, short_block_n=2 * KV_TILE)
    monkeypatch.setattr(planning, "choose_tiles", lambda *_: mixed)
    b = make_batch(MIXED, 4, 2, 32, seed=20 + num_splits)
    run_split(kernels, b, max_query_len=12, max_seq_len=96)
    assert_rows(b.output, expected_of(b), b.num_queries, 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_size", [32, 48], ids=["d32", "d48-padded"])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1)], ids=["gqa4:2", "gqa8:1"])
def test_split_heads_sizes_dtypes_match_torch(kernels, force, heads, head_size: int, dtype) -> None:
    force(3)
    b = make_batch(MIXED, *heads, head_size, seed=head_size + heads[0], dtype=dtype)
    run_split(kernels, b)
    assert b.output.dtype == dtype
    assert_rows(b.output, expected_of(b), b.num_queries, tolerance(dtype))


def test_more_splits_than_any_request_has_tiles(kernels, force) -> None:
    # 5 splits over requests of 1-2 tiles: most programs see an empty range and must store the
    # neutral partial (m = -inf, l = 0), which the merge skips without reading their acc.
    force(5)
    b = make_batch([(1, 9), (1, 1), (1, 17), (1, 32), (1, 16)], 4, 2, 32, seed=41)
    run_split(kernels, b, max_query_len=1, max_seq_len=32)
    assert_rows(b.output, expected_of(b), b.num_queries, 1e-3)


def test_merge_reads_only_written_partials(kernels, force, monkeypatch: pytest.MonkeyPatch) -> None:
    # A NaN-filled workspace: any partial the merge reads without the split kernel having written
    # it (an empty segment's acc, a padding row) turns the output NaN.
    allocate = kernels.split_workspace

    def poisoned(*args):
        return tuple(t.fill_(float("nan")) for t in allocate(*args))
    monkeypatch.setattr(kernels, "split_workspace", poisoned)
    force(5)
    b = make_batch(MIXED, 4, 2, 32, seed=8)
    limit = b.num_queries - 2
    run_split(kernels, b, num_actual_tokens=limit)
    assert_rows(b.output, expected_of(b, limit), limit, 1e-3)


def test_workspace_budget_caps_the_split_count(kernels, force, monkeypatch: pytest.MonkeyPatch) -> None:
    force(5)
    b = make_batch(DECODES, 4, 2, 32, seed=12)
    bytes_per_split = b.query.shape[0] * 4 * (32 + 2) * 4  # T x Hq x (D + 2) float32
    monkeypatch.setattr(planning, "SPLIT_WORKSPACE_BUDGET_BYTES", 2 * bytes_per_split + 1)
    allocate, asked = kernels.split_workspace, []

    def spy(num_tokens, num_heads, num_splits, head_size, device):
        asked.append(num_splits)
        return allocate(num_tokens, num_heads, num_splits, head_size, device)
    monkeypatch.setattr(kernels, "split_workspace", spy)
    run_split(kernels, b)
    assert asked == [2]
    assert_rows(b.output, expected_of(b), b.num_queries, 1e-3)


def test_split_stops_at_num_actual_tokens(kernels, force) -> None:
    force(4)
    b = make_batch(MIXED, 4, 2, 32, seed=5)
    limit = int(b.query_start_loc[4]) + 5  # cuts the chunked prefill of request 4 in half
    run_split(kernels, b, num_actual_tokens=limit)
    assert_rows(b.output, expected_of(b, limit), limit, 1e-3)


def test_split_with_default_tiles_and_strided_output(kernels, force) -> None:
    # The launcher's own tiles (bf16: 64-token KV tiles, 2 of them at most here), int64
    # metadata, and query/output as head-strided views of wider buffers, as a fused QKV gives.
    force(2, small_tiles=False)
    b = make_batch(DECODES, 4, 2, 32, seed=9, dtype=torch.bfloat16)
    wide_q = torch.zeros(b.query.shape[0], 4, 64, dtype=b.query.dtype, device=DEVICE)
    wide_q[..., :32] = b.query
    wide_out = torch.full_like(wide_q, float("nan"))
    b.query, b.output = wide_q[..., :32], wide_out[..., :32]
    b.query_start_loc, b.seq_lens = b.query_start_loc.long(), b.seq_lens.long()
    b.slot_table = b.slot_table.long()
    run_split(kernels, b)
    assert_rows(b.output, expected_of(b), b.num_queries, 2e-2)
    assert torch.isnan(wide_out[..., 32:]).all()  # the other half of each row is not ours


# ---------------------------------------------------------------------------------------------
# graph capture: the split count comes from host-known sizes only


def test_capture_like_call_uses_table_width_and_replays_correctly(kernels, force, monkeypatch) -> None:
    """vLLM captures a decode graph with seq_lens of 1 and replays it with real lengths, and the
    hint may be absent. The real rule (with a pretend 16-SM GPU) must pick the same split count
    for both calls, from the table width, and the 'replay' must still match torch."""
    rule = planning.choose_num_splits
    force(1)  # small tiles; the split count goes back to the real rule just below
    monkeypatch.setattr(planning, "choose_num_splits", _recording(rule, seen := []))
    monkeypatch.setattr(planning, "num_sms", lambda device: 16)
    b = make_batch(DECODES, 4, 2, 32, seed=3)
    real_lens = b.seq_lens.clone()
    b.seq_lens.fill_(1)  # "capture"
    run_split(kernels, b, max_query_len=1, max_seq_len=None)
    b.seq_lens.copy_(real_lens)  # "replay": same shapes, same host arguments
    b.output.fill_(float("nan"))
    run_split(kernels, b, max_query_len=1, max_seq_len=None)
    width_tiles = math.ceil(b.slot_table.shape[1] / KV_TILE)
    (inputs, splits), replayed = seen
    assert replayed == (inputs, splits)
    assert inputs[1:] == (width_tiles, 16)
    assert splits > 1  # the rule did split: the replay ran the split path
    assert_rows(b.output, expected_of(b), b.num_queries, 1e-3)


def _recording(rule, seen: list):
    def wrapper(num_programs, num_kv_tiles, num_sms):
        result = rule(num_programs, num_kv_tiles, num_sms)
        seen.append(((num_programs, num_kv_tiles, num_sms), result))
        return result
    return wrapper


def test_longest_context_prefers_hint_and_bounds_it_by_the_table(kernels, force) -> None:
    calls = force(1)
    b = make_batch(DECODES, 4, 2, 32, seed=4)
    width = b.slot_table.shape[1]
    for hint in (None, 40, 10 * width):
        run_split(kernels, b, max_seq_len=hint)
    assert [tiles for _, tiles in calls] == [math.ceil(n / KV_TILE) for n in (width, 40, width)]


def test_forced_tiles_get_the_planners_split_count_for_that_shape(kernels, monkeypatch) -> None:
    """The GPU sweeps time shapes through choose_launch_shape(tiles=...): the shape is kept, and
    the split count is the one the planner would give a call that chose that shape itself."""
    monkeypatch.setattr(planning, "num_sms", lambda device: 16)  # a GPU small enough to split for
    b = make_batch(DECODES, 4, 2, 32, seed=6)
    args = (b.query, b.k_cache, b.slot_table, b.query_start_loc, 1, None)
    own_tiles, own_splits = planning.choose_launch_shape(*args)
    assert planning.choose_launch_shape(*args, tiles=own_tiles) == (own_tiles, own_splits)
    forced = TileConfig(block_m=16, block_n=KV_TILE)
    assert forced != own_tiles
    tiles, splits = planning.choose_launch_shape(*args, tiles=forced)
    assert tiles == forced and splits > own_splits  # smaller KV tiles: more of them to split
    monkeypatch.setattr(planning, "choose_tiles", lambda *_: forced)  # the planner's own pick, now
    assert planning.choose_launch_shape(*args) == (forced, splits)


# ---------------------------------------------------------------------------------------------
# the split-count rule (pure function)


def test_split_rule_on_h200_shapes(kernels) -> None:
    rule = planning.choose_num_splits
    # Hkv=8, decode: programs = batch x 8; KV tiles of 128 tokens (the decode tiles); 132 SMs.
    assert rule(1 * 8, 32768 // 128, 132) == 29  # one near-full wave of 232 programs
    assert rule(1 * 8, 2048 // 128, 132) == 14  # as many splits as the 16 KV tiles allow within 15%
    assert rule(8 * 8, 8192 // 128, 132) == 4
    assert rule(32 * 8, 8192 // 128, 132) == 1  # already ~a full wave
    assert rule(8, 1, 132) == 1  # one KV tile: nothing to split
    assert rule(8, 512, None) == 1  # no GPU (interpreter): never split on its own


def test_tile_choice_on_llama_shapes(kernels) -> None:
    choose = planning.choose_tiles
    # bf16, head 128, GQA 4 (Llama-3-8B): a decode-only call gets the H200 sweep's shape; a call
    # with longer queries, or one whose queries are unknown (a graph capture replays any batch),
    # gets 64x64 tiles for its long queries and that decode shape for its one-token ones.
    decode = TileConfig(block_m=16, block_n=128, num_warps=4, num_stages=3)
    assert choose(4, 128, 2, 1) == decode
    mixed = TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, short_block_m=16, short_block_n=128)
    assert choose(4, 128, 2, 150) == mixed
    assert choose(4, 128, 2, None) == mixed
    # Head 256 decode: not the measured shape; the shared-memory estimate halves the KV tile.
    assert choose(4, 256, 2, 1) == TileConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)
    assert choose(4, 256, 2, 2) == TileConfig(block_m=64, block_n=64, num_warps=4, num_stages=2,
                                              short_block_m=16, short_block_n=64)


@given(st.sampled_from([1, 2, 4, 5, 8, 16, 32]), st.sampled_from([16, 32, 64, 128, 256]),
       st.sampled_from([2, 4]), st.one_of(st.none(), st.integers(1, 4096)))
def test_tile_choice_bounds(kernels, group, head_pad, itemsize, max_query_len) -> None:
    t = planning.choose_tiles(group, head_pad, itemsize, max_query_len)
    shapes = [(t.block_m, t.block_n)] + ([(t.short_block_m, t.short_block_n)] if t.short_block_m else [])
    for block_m, block_n in shapes:
        # tl.dot needs 16 rows and 16 columns at least; a program holds whole GQA groups.
        assert block_m >= max(16, group) and block_m & (block_m - 1) == 0
        assert 16 <= block_n <= 128 and block_n & (block_n - 1) == 0
        # K/V stages stay within the shared-memory estimate's budget for their kind of tile (the
        # smallest KV tile is taken whatever it costs).
        if itemsize == 2:
            budget = DECODE_KV_STAGE_BUDGET_BYTES if block_m == 16 else KV_STAGE_BUDGET_BYTES
            assert t.num_stages * 2 * block_n * head_pad * itemsize <= budget or block_n == 16
            if block_n < 128:
                assert t.num_stages * 2 * block_n * head_pad * itemsize <= 160 * 1024 or block_n == 16
    if t.short_block_m:  # a short query fits the long queries' tile too: the mixed plan's grid
        assert t.short_block_m <= t.block_m
    assert bool(t.short_block_m) == (itemsize == 2 and (max_query_len is None or max_query_len > 1))


@given(st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 200))
def test_split_rule_bounds(kernels, num_programs: int, num_kv_tiles: int, num_sms: int) -> None:
    splits = planning.choose_num_splits(num_programs, num_kv_tiles, num_sms)
    assert 1 <= splits <= max(1, min(64, num_kv_tiles))
    slots = 2 * num_sms
    if num_programs >= slots:
        assert splits == 1
    else:  # at most 4 waves of programs: this bounds the workspace
        assert splits == 1 or num_programs * splits <= 4 * slots


@pytest.mark.parametrize(("tokens", "heads", "splits"), [(1, 32, 2), (3, 3, 3), (5, 1, 7), (2, 5, 9)])
def test_workspace_partials_are_16_byte_aligned_and_disjoint(kernels, tokens, heads, splits) -> None:
    # Triton specializes a pointer on 16-byte alignment: an odd T*Hq*S must not move the partials
    # (that would compile another kernel variant mid-serving, which the warm-up cannot foresee).
    acc, maxes, sums = kernels.split_workspace(tokens, heads, splits, 32, torch.device(DEVICE))
    assert acc.shape == (tokens, heads, splits, 32)
    assert maxes.shape == sums.shape == (tokens, heads, splits)
    for t in (acc, maxes, sums):
        assert t.data_ptr() % 16 == 0
    acc.fill_(1.0), maxes.fill_(2.0), sums.fill_(3.0)
    assert (acc == 1.0).all() and (maxes == 2.0).all() and (sums == 3.0).all()
