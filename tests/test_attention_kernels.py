"""Slot attention: torch path vs a naive float64 oracle, Triton vs torch, write_kv, argument checks.

On a machine without CUDA the Triton kernels run under the interpreter. TRITON_INTERPRET is read
when a kernel is decorated, so it is set here before anything imports Triton; on a CUDA machine
the kernels run for real on the GPU.
"""

from __future__ import annotations

from tests.attention_cases import (  # first: sets TRITON_INTERPRET on CPU-only machines
    DEVICE,
    INTERPRETER_WARNINGS,
    Batch,
    kv_views,
    make_batch,
    triton_attention_or_skip,
    triton_write_kv_or_skip,
)

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402

from proxima.engine.attention import planning, reference, slot_rows  # noqa: E402
from proxima.engine.attention.planning import TileConfig  # noqa: E402
from proxima.engine.attention.reference import slot_attention_torch  # noqa: E402
from proxima.engine.attention.slot_rows import write_kv  # noqa: E402

pytestmark = INTERPRETER_WARNINGS

# (q_len, seq_len) per request: decodes, a full prefill, chunked prefills that start after cached
# context, a request with no queries this step mid-batch, and a padding request at the end.
MIXED = [(1, 21), (7, 7), (5, 19), (1, 1), (0, 6), (12, 30), (1, 9), (3, 3), (0, 0)]
DECODES = [(1, 13), (1, 1), (1, 40), (1, 7), (1, 26)]
PREFILLS = [(16, 16), (9, 25), (1, 2), (20, 41)]


KV_LAYOUTS = ["split", "slot-interleaved", "head-interleaved"]


def naive_attention(b: Batch, gather=None, query: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """Float64, one request at a time, dense causal attention over the gathered slots.

    `gather(slots) -> (k, v)` reads a request's K/V (default: the batch's caches); `query` and
    `scale` replace the batch's (the per-token-head oracle attends in int4's rotated space)."""
    if gather is None:
        def gather(slots):
            return b.k_cache[slots], b.v_cache[slots]
    query = b.query if query is None else query
    scale = b.scale if scale is None else scale
    group = query.shape[1] // b.k_cache.shape[1]
    out = torch.full(query.shape, float("nan"), dtype=torch.float64)
    starts, seq_lens = b.query_start_loc.cpu().tolist(), b.seq_lens.cpu().tolist()
    for r, seq_len in enumerate(seq_lens):
        start, end = starts[r], starts[r + 1]
        if end == start:
            continue
        k, v = gather(b.slot_table[r, :seq_len].long())
        keys = k.cpu().double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        values = v.cpu().double().repeat_interleave(group, dim=1)
        q = query[start:end].cpu().double()
        scores = torch.einsum("qhd,lhd->hql", q, keys) * scale
        positions = seq_len - (end - start) + torch.arange(end - start)
        hidden = torch.arange(seq_len)[None, :] > positions[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("hql,lhd->qhd", torch.softmax(scores, dim=-1), values)
    return out


def assert_rows(
    out: torch.Tensor, expected: torch.Tensor, num_written: int, atol: float, rtol: float
) -> None:
    """Rows below num_written match; every row from num_written on is still NaN (untouched)."""
    out = out.cpu()
    assert torch.isfinite(out[:num_written]).all()
    torch.testing.assert_close(out[:num_written].to(expected.dtype), expected[:num_written],
                               atol=atol, rtol=rtol)
    assert torch.isnan(out[num_written:]).all()


# ---------------------------------------------------------------------------------------------
# (1) torch path vs float64 oracle


@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (4, 4)], ids=["gqa4:2", "gqa8:1", "mha"])
@pytest.mark.parametrize("head_size", [32, 64])
@pytest.mark.parametrize("fragmented", [True, False], ids=["fragmented", "contiguous"])
def test_torch_mixed_batch_matches_float64(heads: tuple[int, int], head_size: int, fragmented: bool) -> None:
    seed = heads[0] * 100 + head_size + fragmented
    b = make_batch(MIXED, *heads, head_size, fragmented=fragmented, seed=seed)
    out = slot_attention_torch(*b.args())
    assert out is b.output
    assert_rows(out, naive_attention(b), int(b.query_start_loc[-1]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("requests", [DECODES, PREFILLS, [(1, 5)], [(6, 6)]],
                         ids=["decodes", "prefills", "one-decode", "one-prefill"])
@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_torch_batch_shapes_match_float64(requests: list[tuple[int, int]], layout: str) -> None:
    b = make_batch(requests, 8, 2, 32, fragmented=True, seed=len(requests), layout=layout)
    slot_attention_torch(*b.args())
    assert_rows(b.output, naive_attention(b), int(b.query_start_loc[-1]), atol=1e-4, rtol=1e-4)


def test_torch_chunks_under_small_gather_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    # A budget below one request's context forces one-request decode chunks and one-row prefill pieces.
    monkeypatch.setattr(reference, "_GATHER_BUDGET_ELEMENTS", 700)
    b = make_batch(MIXED + DECODES, 4, 2, 32, fragmented=True, seed=7)
    slot_attention_torch(*b.args())
    assert_rows(b.output, naive_attention(b), int(b.query_start_loc[-1]), atol=1e-4, rtol=1e-4)


def test_torch_num_actual_tokens_bounds_written_rows() -> None:
    b = make_batch(MIXED, 4, 2, 32, fragmented=True, seed=3)
    limit = int(b.query_start_loc[2]) + 2  # cuts the chunked prefill of request 2 in half
    slot_attention_torch(*b.args(), num_actual_tokens=limit)
    assert_rows(b.output, naive_attention(b), limit, atol=1e-4, rtol=1e-4)


def test_torch_bf16_storage_matches_float64() -> None:
    b = make_batch(MIXED, 4, 2, 64, fragmented=True, seed=5, dtype=torch.bfloat16)
    slot_attention_torch(*b.args())
    assert b.output.dtype == torch.bfloat16
    assert_rows(b.output.float(), naive_attention(b), int(b.query_start_loc[-1]), atol=2e-2, rtol=2e-2)


def test_torch_rejects_inconsistent_metadata() -> None:
    b = make_batch(MIXED, 4, 2, 32, fragmented=True, seed=9)
    short = b.seq_lens.clone()
    short[2] = 2  # fewer cached tokens than the request's 5 queries
    with pytest.raises(ValueError, match="seq_lens < its query length"):
        slot_attention_torch(b.query, b.k_cache, b.v_cache, b.slot_table, b.query_start_loc, short,
                             b.scale, b.output)


# ---------------------------------------------------------------------------------------------
# (1b) packed rows: K and V halves of one row (the backend's layout) take the one-gather path

PACKED_LAYOUTS = ["head-interleaved", "slot-interleaved"]
EQUAL_DECODES = [(1, 9)] * 4  # no padding: the decode chunk runs without a mask


@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (4, 4)], ids=["gqa4:2", "gqa8:1", "mha"])
@pytest.mark.parametrize("requests", [MIXED, DECODES, EQUAL_DECODES, PREFILLS],
                         ids=["mixed", "decodes", "equal-decodes", "prefills"])
def test_torch_packed_rows_match_float64(layout: str, heads: tuple[int, int],
                                         requests: list[tuple[int, int]]) -> None:
    b = make_batch(requests, *heads, 32, fragmented=True, seed=len(requests) + heads[1], layout=layout)
    assert slot_rows.kv_rows(b.k_cache, b.v_cache) is not None
    slot_attention_torch(*b.args())
    assert_rows(b.output, naive_attention(b), int(b.query_start_loc[-1]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("layout", PACKED_LAYOUTS)
def test_torch_packed_rows_under_small_gather_budget(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    # Decode chunks of one or two requests taken longest first (rows out of batch order) and
    # prefill pieces of a few rows (every piece after the first under an additive mask).
    monkeypatch.setattr(reference, "_GATHER_BUDGET_ELEMENTS", 700)
    b = make_batch(MIXED + DECODES, 4, 2, 32, fragmented=True, seed=17, layout=layout)
    slot_attention_torch(*b.args())
    assert_rows(b.output, naive_attention(b), int(b.query_start_loc[-1]), atol=1e-4, rtol=1e-4)


def test_torch_packed_rows_bf16_and_num_actual_tokens() -> None:
    b = make_batch(MIXED, 4, 2, 64, fragmented=True, seed=23, dtype=torch.bfloat16, layout="head-interleaved")
    limit = int(b.query_start_loc[5]) + 4  # cuts the chunked prefill of request 5
    slot_attention_torch(*b.args(), num_actual_tokens=limit)
    assert_rows(b.output.float(), naive_attention(b), limit, atol=2e-2, rtol=2e-2)


def test_kv_rows_detects_only_exact_row_tiling() -> None:
    num_slots, heads, head_size = 6, 2, 8
    kv = torch.randn(num_slots, 1, heads, 2 * head_size)  # the backend's per-layer tensor
    rows = kv.view(num_slots, heads, 2 * head_size)
    packed = slot_rows.kv_rows(rows[..., :head_size], rows[..., head_size:])
    assert packed is not None and packed[1] == head_size
    assert torch.equal(packed[0], kv.view(num_slots, -1))
    gen = torch.Generator().manual_seed(0)
    assert slot_rows.kv_rows(*kv_views(num_slots, heads, head_size, "split", gen, torch.float32)) is None
    wide = torch.randn(num_slots, heads, 3 * head_size)  # a third block in every row is not K or V
    assert slot_rows.kv_rows(wide[..., :head_size], wide[..., head_size:2 * head_size]) is None
    assert slot_rows.kv_rows(rows[..., head_size:], rows[..., :head_size]) is None  # V before K
    assert slot_rows.kv_rows(rows[..., ::2], rows[..., 1::2]) is None  # head dim not contiguous


# ---------------------------------------------------------------------------------------------
# (3) write_kv


def _write_case(seed: int, layout: str, index_dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    num_slots, heads, head_size = 40, 2, 32
    k_cache, v_cache = kv_views(num_slots, heads, head_size, layout, gen, torch.float32)
    # Strided sources, as when key/value are slices of a fused QKV projection; 2 padding rows.
    key, value = torch.randn(9, heads, 3 * head_size, generator=gen).to(DEVICE).split(head_size, dim=2)[:2]
    slots = torch.randperm(num_slots, generator=gen)[:7]
    slots[[1, 4]] = -1  # padding tokens
    return key, value, k_cache, v_cache, slots.to(index_dtype).to(DEVICE)


def _check_written(writer, seed: int, layout: str, index_dtype: torch.dtype) -> None:
    key, value, k_cache, v_cache, slot_mapping = _write_case(seed, layout, index_dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    writer(key, value, k_cache, v_cache, slot_mapping)
    k_expect, v_expect = k_before.clone(), v_before.clone()
    for row, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_expect[slot], v_expect[slot] = key[row], value[row]
    assert torch.equal(k_cache, k_expect)
    assert torch.equal(v_cache, v_expect)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_kv_places_rows_and_skips_padding(layout: str, index_dtype: torch.dtype) -> None:
    _check_written(write_kv, 11, layout, index_dtype)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_write_kv_without_padding(layout: str) -> None:
    key, value, k_cache, v_cache, _ = _write_case(13, layout, torch.int64)
    slot_mapping = torch.tensor([5, 0, 39, 17, 2, 30, 8], device=DEVICE)  # 7 of the 9 rows, no padding
    k_before, v_before = k_cache.clone(), v_cache.clone()
    write_kv(key, value, k_cache, v_cache, slot_mapping)
    for row, slot in enumerate(slot_mapping.tolist()):
        k_before[slot], v_before[slot] = key[row], value[row]
    assert torch.equal(k_cache, k_before)
    assert torch.equal(v_cache, v_before)


def test_write_kv_leaves_the_rest_of_a_row_alone() -> None:
    # K and V two thirds of each row: not a packed layout, and the third block must survive.
    num_slots, heads, head_size = 10, 2, 8
    wide = torch.randn(num_slots, heads, 3 * head_size)
    before = wide.clone()
    key, value = torch.randn(2, 3, heads, head_size).unbind(0)
    write_kv(key, value, wide[..., :head_size], wide[..., head_size:2 * head_size], torch.tensor([4, -1, 7]))
    assert torch.equal(wide[..., 2 * head_size:], before[..., 2 * head_size:])
    assert torch.equal(wide[[4, 7], :, :head_size], key[[0, 2]])
    assert torch.equal(wide[[4, 7], :, head_size:2 * head_size], value[[0, 2]])
    untouched = [s for s in range(num_slots) if s not in (4, 7)]
    assert torch.equal(wide[untouched], before[untouched])


def test_write_kv_rejects_out_of_range_slot() -> None:
    key, value, k_cache, v_cache, slot_mapping = _write_case(1, "split", torch.int64)
    slot_mapping[0] = k_cache.shape[0]
    with pytest.raises(ValueError, match="out of range"):
        write_kv(key, value, k_cache, v_cache, slot_mapping)


# ---------------------------------------------------------------------------------------------
# (4) argument checks, shared by both launchers


def _bad_attention_args(b: Batch) -> dict[str, tuple]:
    q, k, v, table, qsl, seq_lens, scale, out = b.args()
    return {
        "output-dtype": (q, k, v, table, qsl, seq_lens, scale, out.to(torch.float16)),
        "output-shape": (q, k, v, table, qsl, seq_lens, scale, out[:-1]),
        "query-2d": (q[:, 0], k, v, table, qsl, seq_lens, scale, out[:, 0]),
        "heads-not-multiple": (q[:, :3], k, v, table, qsl, seq_lens, scale, out[:, :3]),
        "head-size": (q[..., :16], k, v, table, qsl, seq_lens, scale, out[..., :16]),
        "cache-dtype": (q, k.double(), v.double(), table, qsl, seq_lens, scale, out),
        "v-shape": (q, k, v[:-1], table, qsl, seq_lens, scale, out),
        "table-1d": (q, k, v, table[0], qsl, seq_lens, scale, out),
        "table-float": (q, k, v, table.float(), qsl, seq_lens, scale, out),
        "table-rows": (q, k, v, table[:3], qsl, seq_lens, scale, out),
        "qsl-empty": (q, k, v, table, qsl[:0], seq_lens, scale, out),
        "seq-lens-short": (q, k, v, table, qsl, seq_lens[:2], scale, out),
    }


def _bad_write_args() -> dict[str, tuple]:
    key, value, k_cache, v_cache, slots = _write_case(2, "split", torch.int32)
    return {
        "value-shape": (key, value[:, :1], k_cache, v_cache, slots),
        "key-heads": (key[:, :1], value[:, :1], k_cache, v_cache, slots),
        "cache-dtype": (key, value, k_cache.double(), v_cache.double(), slots),
        "slots-float": (key, value, k_cache, v_cache, slots.float()),
        "slots-too-many": (key[:3], value[:3], k_cache, v_cache, slots),
    }


def test_torch_rejects_bad_arguments() -> None:
    b = make_batch(MIXED, 4, 2, 32, fragmented=True, seed=1)
    for name, args in _bad_attention_args(b).items():
        with pytest.raises(ValueError, match="slot attention"):
            slot_attention_torch(*args)
        assert torch.isnan(b.output).all(), name
    with pytest.raises(ValueError, match="num_actual_tokens"):
        slot_attention_torch(*b.args(), num_actual_tokens=b.query.shape[0] + 1)
    for args in _bad_write_args().values():
        with pytest.raises(ValueError, match="write_kv"):
            write_kv(*args)


# ---------------------------------------------------------------------------------------------
# (2) Triton vs torch (interpreter on CPU, real kernels on CUDA)


@pytest.fixture(scope="module")
def triton_attention():
    return triton_attention_or_skip()


@pytest.fixture(scope="module")
def triton_write_kv():
    return triton_write_kv_or_skip()


# A mixed plan at interpreter scale: requests whose queries fit 16 rows take those (and 32-token KV
# tiles), longer ones 32-row tiles over 16-token KV tiles, in one launch.
MIXED_TILES = TileConfig(block_m=32, block_n=16, short_block_m=16, short_block_n=32)


@pytest.fixture(params=["default-tiles", "small-tiles", "mixed-tiles"])
def tiles(request, triton_attention, monkeypatch: pytest.MonkeyPatch) -> str:
    """Small tiles put several query tiles in one request and several KV tiles in one context."""
    tiles = {"small-tiles": TileConfig(block_m=16, block_n=16), "mixed-tiles": MIXED_TILES}
    forced = tiles.get(request.param)
    if forced is not None:
        monkeypatch.setattr(planning, "choose_tiles", lambda *args: forced)
    return request.param


@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (2, 2)], ids=["gqa4:2", "gqa8:1", "mha"])
@pytest.mark.parametrize("fragmented", [True, False], ids=["fragmented", "contiguous"])
def test_triton_matches_torch(triton_attention, tiles: str, heads: tuple[int, int], fragmented: bool) -> None:
    b = make_batch(MIXED, *heads, 32, fragmented=fragmented, seed=sum(heads) + fragmented)
    expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))))
    out = triton_attention.slot_attention_triton(*b.args())
    assert out is b.output
    assert_rows(out, expected.cpu(), int(b.query_start_loc[-1]), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize(
    "case",
    ["decodes", "prefills", "head-size-48", "group-3", "slot-interleaved", "head-interleaved",
     "num-actual-tokens", "bf16", "int64-metadata", "hints", "stale-hint"],
)
def test_triton_edge_cases_match_torch(triton_attention, tiles: str, case: str) -> None:
    requests = {"decodes": DECODES, "prefills": PREFILLS}.get(case, MIXED)
    heads = (6, 2) if case == "group-3" else (4, 2)  # group 3 leaves spare rows in a 16-row tile
    head_size = 48 if case == "head-size-48" else 32  # 48 is padded to 64 inside the kernel
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    b = make_batch(requests, *heads, head_size, fragmented=True, seed=len(case), dtype=dtype,
                   layout=case if case in KV_LAYOUTS else "split")
    if case == "int64-metadata":
        b.slot_table, b.query_start_loc = b.slot_table.long(), b.query_start_loc.long()
        b.seq_lens = b.seq_lens.long()
    limit = int(b.query_start_loc[-1]) - 3 if case == "num-actual-tokens" else None
    expected = slot_attention_torch(*b.args(torch.full_like(b.output, float("nan"))), num_actual_tokens=limit,
                                    max_query_len=7, max_seq_len=7)  # ignored by the torch path
    q_lens = b.query_start_loc[1:] - b.query_start_loc[:-1]
    # Hints only pick tiles: an exact one, and a stale one claiming a decode-only batch.
    hints = {"hints": dict(max_query_len=int(q_lens.max()), max_seq_len=int(b.seq_lens.max())),
             "stale-hint": dict(max_query_len=1, max_seq_len=1)}.get(case, {})
    triton_attention.slot_attention_triton(*b.args(), num_actual_tokens=limit, **hints)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
    num_written = limit or int(b.query_start_loc[-1])
    assert_rows(b.output.float(), expected.float().cpu(), num_written, atol=tol, rtol=tol)


@pytest.mark.parametrize("layout", KV_LAYOUTS)
def test_write_kv_triton_places_rows_and_skips_padding(triton_write_kv, layout: str) -> None:
    _check_written(triton_write_kv.write_kv_triton, 12, layout, torch.int32)


def test_triton_launchers_reject_bad_arguments(triton_attention, triton_write_kv) -> None:
    b = make_batch(MIXED, 4, 2, 32, fragmented=True, seed=1)
    bad = _bad_attention_args(b)
    q, k, v, table, qsl, seq_lens, scale, out = b.args()
    wide = torch.randn(q.shape[0], 4, 64, device=DEVICE)
    bad["query-d-stride"] = (wide[..., ::2], k, v, table, qsl, seq_lens, scale, out)
    bad["table-column-stride"] = (q, k, v, table.t().contiguous().t(), qsl, seq_lens, scale, out)
    for name, args in bad.items():
        with pytest.raises(ValueError, match="slot"):
            triton_attention.slot_attention_triton(*args)
        assert torch.isnan(b.output).all(), name
    for args in _bad_write_args().values():
        with pytest.raises(ValueError, match="write_kv"):
            triton_write_kv.write_kv_triton(*args)
    key = torch.randn(3, 2, 64, device=DEVICE)[..., ::2]  # D values two apart
    cache = torch.zeros(8, 2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="write_kv_triton: key must have unit stride along D"):
        triton_write_kv.write_kv_triton(key, key.contiguous(), cache, cache.clone(),
                                        torch.arange(3, device=DEVICE))
