"""Triton kernels for slot attention, each beside the thin launcher that checks its arguments.

Same contract as ``reference.py`` (its docstring states it; ``slot_attention_torch`` is the
reference these kernels are tested against). Runs on CUDA, and on CPU under ``TRITON_INTERPRET=1``
(set before Triton is imported), which is how CI tests it.

Design of ``_slot_attention_kernel`` (one "unified" kernel for prefill, chunked prefill and
decode):

- grid = (query tiles, kv heads). A query tile is ``BLOCK_Q`` consecutive query tokens of one
  request times the ``GROUP = Hq // Hkv`` query heads that share one KV head, i.e.
  ``BLOCK_Q * GROUP`` rows (``BLOCK_M``, a power of two, >= that), so each K/V tile is loaded
  once per GQA group. ``planning.choose_tiles`` picks the sizes from shapes alone.
- the tiles are flattened over all requests: request ``r`` owns tiles starting at
  ``query_start_loc[r] // BLOCK_Q + r``; a program finds its request by binary search. The grid
  is an upper bound computed from shapes alone, so launching never reads device memory on the
  host (no sync, CUDA-graph friendly); surplus programs exit at once.
- K/V are read ``BLOCK_N`` token positions at a time, each position's slot looked up in
  ``slot_table``, with an online softmax in float32.
- one program's work (a query tile over its KV range) is ``triton_query_tile``; the tile loop,
  ``_attend_kv_tiles``, takes a ``[tile_start, tile_end)`` range.
- mixed plans (any call whose queries may be longer than one token, and every CUDA-graph
  capture, since a FULL graph replays mixed steps): a request whose queries fit one decode-shaped
  tile (``SHORT_BLOCK_M`` rows, ``SHORT_BLOCK_N``-token KV tiles) is attended with that shape by
  its first program, chosen on the GPU from its query length; longer ones get ``BLOCK_M``-row
  tiles. One launch, one grid, whatever the mix: a decode does not pay for 64 mostly empty rows.
- dense-tile reads (``TileConfig.dense_kv``, not planned yet: docs/benchmarks.md, issue 18): a
  long-tile program whose slots are one ascending run reads K/V through 2-D tensor descriptors
  (TMA on Hopper) instead of the gather, decided on the GPU per program.

Split-KV (flash-decoding), for launches whose grid is too small to fill the GPU (small batches
of long decodes: the grid is ~ requests x Hkv programs, each walking its whole context alone):

- the same kernel, compiled with ``SPLIT``, gets a third grid axis of ``num_splits`` programs per
  query tile; split ``s`` attends KV tiles ``[s*n // S, (s+1)*n // S)`` of the ``n`` its query
  tile can see, so segments are whole ``BLOCK_N`` tiles, balanced per request, computed in the
  kernel from the real ``seq_lens``. Segments never depend on the hint: a stale or missing
  ``max_seq_len`` (graph capture) costs speed only, and a split count above a request's tile
  count leaves empty segments, which store the neutral partial (m = -inf, l = 0);
- every program stores unnormalised ``(acc, m, l)`` per row into a float32 workspace sized from
  host-known numbers only (T, Hq, D, S), and ``triton_merge_splits`` combines the S partials of
  each (token, head) with a log-sum-exp into ``output``;
- one split count per launch applies to every tile, prefill tiles included: correctness never
  rests on the batch being decode-only, the kernel body stays one, and a short chunked prefill
  over a long context (few tiles) gains the same parallelism. Splits are only chosen when the
  grid is small, which keeps T small; a byte budget caps the workspace regardless.

fp8 caches (``quant.py`` states the semantics, vLLM's; ``triton_write_kv`` writes them). The
attention kernel loads fp8 K/V tiles and widens them exactly to the dot
dtype inside the gather; it never multiplies a tile by its scale: ``k_scale`` is folded into the
softmax scale (``qk_scale``) and ``v_scale`` into the epilogue (the unnormalised accumulator,
before the division or the split partial's store, so the merge needs nothing). Scales are read
in-kernel from the layer's tensors (one element, or one per KV head: ``SCALE_STRIDE`` 0 or 1),
so nothing syncs the host and a CUDA graph replays with whatever values they hold.

Constraints: head size is padded to a power of two >= 16 inside the kernel (any D works; a power
of two wastes nothing). Storage must be fp16, bf16, fp32, or fp8 (e4m3 / e5m2) with its scales,
with unit stride along D.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import triton
import triton.language as tl
from torch import Tensor

from proxima.engine.attention import gluon_int4_decode, launch_args
from proxima.engine.attention.checks import check_attention_args, check_unit_stride
from proxima.engine.attention.kernel_launch import CompiledLaunch, tensor_key
from proxima.engine.attention.launch_args import (
    check_backend,
    code_args,
    dot_dtype,
    int4_ptx,
    interpreting,
    scale_args,
    split_workspace,
)
from proxima.engine.attention.planning import (
    TileConfig,
    capturing,
    choose_launch_shape,
    grid_tiles,
    head_size_pad,
)
from proxima.engine.attention.quant import KVScales
from proxima.engine.attention.triton_dense_kv import dense_kv_ok, kv_descriptors
from proxima.engine.attention.triton_merge_splits import UNSPECIALIZED, merge_launch
from proxima.engine.attention.triton_query_tile import _attend_query_tile

_LOG2_E = 1.4426950408889634


@triton.jit
def _find_request(query_start_loc_ptr, tile_idx, num_requests, BLOCK_Q: tl.constexpr):
    """Last request r whose first tile (query_start_loc[r] // BLOCK_Q + r) is <= tile_idx."""
    lo: tl.int32 = 0
    hi: tl.int32 = num_requests
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_requests"])
def _longest_query_kernel(query_start_loc_ptr, out_ptr, num_requests, BLOCK: tl.constexpr):
    """out[0] = max over requests of query_start_loc[r + 1] - query_start_loc[r] (one program)."""
    longest = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_requests, BLOCK):
        r = start + tl.arange(0, BLOCK)
        inside = r < num_requests
        first = tl.load(query_start_loc_ptr + r, mask=inside, other=0)
        end = tl.load(query_start_loc_ptr + r + 1, mask=inside, other=0)
        longest = tl.maximum(longest, end - first)
    tl.store(out_ptr, tl.max(longest, axis=0))


_launch_longest_query = CompiledLaunch(_longest_query_kernel)
_LONGEST_QUERY_BLOCK = 512


def longest_query_launch(query_start_loc: Tensor) -> tuple[Tensor, tuple]:
    """A one-element int32 tensor and the plan entry (launcher, grid, args, key, options) that
    writes the batch's longest query into it, on the GPU: no host sync, so a CUDA graph replays it
    with each batch."""
    out = torch.empty(1, dtype=torch.int32, device=query_start_loc.device)
    tensors = (query_start_loc, out)
    args = (*tensors, query_start_loc.shape[0] - 1, _LONGEST_QUERY_BLOCK)
    key = (query_start_loc.device.index, tensor_key(tensors), _LONGEST_QUERY_BLOCK)
    return out, (_launch_longest_query, (1, 1, 1), args, key, {"num_warps": 4})


def longest_query(query_start_loc: Tensor) -> Tensor:
    """The batch's longest query as a one-element int32 tensor on its device (one launch): what a
    caller computes once a step and gives each layer's `slot_attention_triton`."""
    out, (launch, grid, args, key, options) = longest_query_launch(query_start_loc)
    launch(grid, args, key, **options)
    return out


@triton.jit(do_not_specialize=UNSPECIALIZED)
def _slot_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, slot_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    acc_ws_ptr, m_ws_ptr, l_ws_ptr, k_scale_ptr, v_scale_ptr, rht_ptr, signs_ptr, longest_query_ptr,
    k_desc, v_desc, qk_scale, num_requests, num_actual_tokens, num_splits,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_table_r, stride_ks_s, stride_ks_h,
    stride_acc_t, stride_acc_h, stride_acc_s, stride_ml_t, stride_ml_h,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SHORT_BLOCK_M: tl.constexpr, SHORT_BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, SHORT_DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    QUANT: tl.constexpr, SCALE_STRIDE: tl.constexpr, FP8_MAX: tl.constexpr, DENSE_KV: tl.constexpr,
    KV_CODES: tl.constexpr, ROT_DTYPE: tl.constexpr, INT4_PTX: tl.constexpr, ROT_BUTTERFLY: tl.constexpr,
    INT4_PREFETCH: tl.constexpr, ROLE: tl.constexpr,
):
    """Unified (``SPLIT`` False: writes ``out``) or one KV segment (``SPLIT``: writes partials).

    ``SHORT_BLOCK_M`` > 0 (a mixed plan): a request whose queries fit one tile of that many rows
    is attended with that tile and ``SHORT_BLOCK_N``-token KV tiles instead (its only program is
    its first ``BLOCK_Q`` tile, since a short query fits there too). ``ROLE`` (a mixed plan of two
    launches, ``TileConfig.short_launch``): 1 attends only the short requests, program 0 of axis 0
    being request 0 (the grid has one per request); 2 only the others; 0 both. A ROLE 2 launch
    reads the batch's longest query (``longest_query``) first: when every request is short, the
    other launch serves them all, and each program returns after that one load instead of
    searching for its request (a decode-only step replayed from a mixed CUDA graph)."""
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    if ROLE == 2:
        if tl.load(longest_query_ptr) <= SHORT_BLOCK_M // GROUP:
            return
    if ROLE == 1:
        req = tile_idx
    else:
        req = _find_request(query_start_loc_ptr, tile_idx, num_requests, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    short = q_len <= SHORT_BLOCK_M // GROUP
    if ROLE == 1:
        local_tile = 0
        if (q_len == 0) | (q_len > SHORT_BLOCK_M // GROUP):
            return
    else:
        local_tile = tile_idx - (q_start // BLOCK_Q + req)
        if local_tile * BLOCK_Q >= q_len:  # surplus program, or a request with no queries
            return
        if ROLE == 2 and short:  # the short launch's
            return
    seq_len = tl.load(seq_lens_ptr + req)
    slot_row_ptr = slot_table_ptr + req.to(tl.int64) * stride_table_r
    # A constexpr branch first: without a short shape there is nothing to compile for one.
    if SHORT_BLOCK_M > 0 and ROLE != 2 and (ROLE == 1 or short):
        _attend_query_tile(
            q_ptr, k_ptr, v_ptr, out_ptr, slot_row_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, k_scale_ptr,
            v_scale_ptr, rht_ptr, signs_ptr, k_desc, v_desc, qk_scale, num_actual_tokens, num_splits, q_start,
            q_len, seq_len, 0, kv_head,
            stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h,
            stride_ks_s, stride_ks_h, stride_acc_t, stride_acc_h, stride_acc_s, stride_ml_t, stride_ml_h,
            HEAD_SIZE, HEAD_SIZE_PAD, GROUP, max(SHORT_BLOCK_M // GROUP, 1), max(SHORT_BLOCK_M, 16),
            max(SHORT_BLOCK_N, 16), SHORT_DOT_DTYPE, DOT_PRECISION, SPLIT, QUANT, SCALE_STRIDE, False,
            KV_CODES, ROT_DTYPE, INT4_PTX, ROT_BUTTERFLY, INT4_PREFETCH,
        )
    else:
        _attend_query_tile(
            q_ptr, k_ptr, v_ptr, out_ptr, slot_row_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, k_scale_ptr,
            v_scale_ptr, rht_ptr, signs_ptr, k_desc, v_desc, qk_scale, num_actual_tokens, num_splits, q_start,
            q_len, seq_len, local_tile, kv_head, stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_k_s,
            stride_k_h, stride_v_s, stride_v_h, stride_ks_s, stride_ks_h, stride_acc_t, stride_acc_h,
            stride_acc_s, stride_ml_t, stride_ml_h,
            HEAD_SIZE, HEAD_SIZE_PAD, GROUP, BLOCK_Q, BLOCK_M, BLOCK_N,
            DOT_DTYPE, DOT_PRECISION, SPLIT, QUANT, SCALE_STRIDE, DENSE_KV, KV_CODES, ROT_DTYPE, INT4_PTX,
            ROT_BUTTERFLY, INT4_PREFETCH,
        )


_launch_attention = CompiledLaunch(_slot_attention_kernel)


def slot_attention_triton(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    output: Tensor,
    num_actual_tokens: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    graph_max_query_len: int | None = None,
    kv_scales: KVScales | None = None,
    longest_query: Callable[[], Tensor] | None = None,
) -> Tensor:
    """Triton ``slot_attention_torch``: same signature, same semantics, writes ``output`` in place.

    ``max_query_len`` / ``max_seq_len`` are optional host-side hints (vLLM's metadata has them):
    they pick tile shapes and the split-KV count, and never change the result, so a stale hint
    costs speed, not correctness. Without ``max_seq_len``, or while a CUDA graph is being
    captured (the graph replays with other lengths), the slot table width stands in for it.
    While a graph is captured the query-length hint is dropped too (a mixed plan, which serves any
    batch), unless ``graph_max_query_len`` bounds the queries of every batch the graph will replay:
    vLLM's uniform-decode graphs replay only batches of 1 + speculative tokens a request, and those
    get the decode plan. ``longest_query``: returns the batch's longest query on the device,
    called only by a plan that reads it (the backend's keeps one a step for all layers); without
    it such a plan computes its own (`longest_query`).

    Metadata values are trusted (checking them would sync the device): ``query_start_loc`` must be
    non-decreasing with ``query_start_loc[-1] <= T``, and ``q_len <= seq_lens[r] <= slot_table
    width`` for every request with queries.
    """
    check_attention_args(query, k_cache, v_cache, slot_table, query_start_loc, seq_lens, output,
                         num_actual_tokens, kv_scales)
    check_unit_stride("slot_attention_triton",
                      (("query", query), ("output", output), ("k_cache", k_cache), ("v_cache", v_cache)))
    if slot_table.stride(1) != 1:
        raise ValueError(
            f"slot_attention_triton: slot_table rows must be contiguous, got strides {slot_table.stride()}"
        )
    if not (query_start_loc.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("slot_attention_triton: query_start_loc and seq_lens must be contiguous")
    check_backend(query, "slot_attention_triton")

    num_tokens, num_requests = query.shape[0], query_start_loc.shape[0] - 1
    if num_requests == 0 or num_tokens == 0:
        return output
    tiles, num_splits = choose_launch_shape(query, k_cache, slot_table, query_start_loc, max_query_len,
                                            max_seq_len, graph_max_query_len=graph_max_query_len)
    row_limit = num_tokens if num_actual_tokens is None else num_actual_tokens
    # A uniform-decode graph replays only batches whose requests fit the int4 decode kernel: its
    # launch alone serves them (a hint could be stale; this bound is the graph's).
    group = query.shape[1] // k_cache.shape[1]
    decodes_only = (capturing(slot_table) and graph_max_query_len is not None
                    and graph_max_query_len * group <= gluon_int4_decode.ROWS_OUT)
    for launch, grid, args, key, options in _launch_plan(
        query, k_cache, v_cache, slot_table, query_start_loc, seq_lens, scale, output, row_limit, tiles,
        num_splits, kv_scales, decodes_only, longest_query,
    ):
        launch(grid, args, key, **options)
    return output


def _launch_plan(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, scale: float, output: Tensor, row_limit: int, tiles: TileConfig, num_splits: int,
    kv_scales: KVScales | None = None, decodes_only: bool = False,
    longest_query: Callable[[], Tensor] | None = None,
) -> list[tuple[CompiledLaunch, tuple[int, int, int], tuple, tuple, dict]]:
    """The kernel launches of one attention call: (launcher, grid, args, cache key, options) each.

    One place builds them for both the launch and `warmup.compile_attention_variants`, so a warmed-up
    variant is exactly the one a later call looks up.

    An int4 cache's mixed plan, where ``gluon_int4_decode`` serves the shapes: that kernel attends
    the requests of at most ``ROWS_OUT`` rows (decodes), the unified kernel the others (its long
    launch, whose short-request threshold becomes those rows); ``decodes_only`` (every request is
    such a one, a bound the caller guarantees): the decode kernel alone. The unified kernel's
    launch beside it reads the batch's longest query (``longest_query``, or a launch of its own
    first) and returns at once when there is none longer than the decode kernel takes.
    """
    num_tokens, num_query_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[1]
    num_requests = query_start_loc.shape[0] - 1
    group = num_query_heads // num_kv_heads
    padded = head_size_pad(head_size)
    block_q = tiles.block_m // group
    num_tiles = grid_tiles(num_tokens, num_requests, block_q)
    if num_splits == 1:
        # Placeholders: the unified kernel compiles every use of the workspace away.
        acc_ws, m_ws, l_ws, ws_strides = output, output, output, (0,) * 5
    else:
        acc_ws, m_ws, l_ws = split_workspace(num_tokens, num_query_heads, num_splits, head_size,
                                              query.device)
        ws_strides = (*acc_ws.stride()[:3], *m_ws.stride()[:2])
    k_scale, v_scale, quant = scale_args(kv_scales, k_cache)
    codes, scale_strides, (rht, signs) = code_args(kv_scales, query)
    int4_decode = codes == 2 and tiles.short_block_m > 0 and gluon_int4_decode.serves(query, group)
    if int4_decode:  # the unified kernel leaves requests of up to ROWS_OUT rows to the decode kernel
        tiles = replace(tiles, short_block_m=gluon_int4_decode.ROWS_OUT, short_launch=None)
    if codes == 2:  # int4 read as words: the kernel takes int32 views of the same codes
        k_cache, v_cache = kv_scales.k_words, kv_scales.v_words
    dense_kv = tiles.dense_kv and not codes and dense_kv_ok(query, k_cache, v_cache, head_size)
    # Without dense reads the caches stand in for the descriptors (never read: compiled away).
    descriptors = (kv_descriptors(k_cache, v_cache, tiles.block_n, head_size) if dense_kv
                   else (k_cache, v_cache))
    # Launch arguments in the kernel's parameter order, constexprs last (see kernel_launch.py).
    # A plan of two launches (a ROLE 2 launch beside the short requests' own) reads the longest query.
    two_launches = not decodes_only if int4_decode else tiles.short_launch is not None
    # query_start_loc stands in for it where no launch reads it (int32 as well).
    longest, prelude = query_start_loc, []
    if two_launches and longest_query is not None:
        longest = longest_query()
    elif two_launches:
        longest, entry = longest_query_launch(query_start_loc)
        prelude.append(entry)
    tensors = (query, k_cache, v_cache, output, slot_table, query_start_loc, seq_lens, acc_ws, m_ws, l_ws,
               k_scale, v_scale, rht, signs, longest)
    if codes == 2:  # int4 attends in vLLM's rotated space, whose dot products are D times larger
        scale = scale / head_size
    runtime = (float(scale) * _LOG2_E, num_requests, row_limit, num_splits)  # not specialized on
    strides = (query.stride(0), query.stride(1), output.stride(0), output.stride(1),
               k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               slot_table.stride(0), *scale_strides)
    constexprs = (head_size, padded, group, block_q, tiles.block_m, tiles.block_n,
                  tiles.short_block_m, tiles.short_block_n,
                  # The long tiles of a mixed plan keep the storage dtype: fp16 dots over fp8 there
                  # took the mixed kernel past 255 registers (sm_90 build); see dot_dtype.
                  dot_dtype(query.dtype, None if tiles.short_block_m else k_cache.dtype),
                  dot_dtype(query.dtype, k_cache.dtype),
                  # fp32 storage would otherwise be multiplied in TF32 (10-bit mantissa); 3xTF32
                  # kept fp32-level error (3e-7 vs 3e-7 for "ieee") at 2-30x the speed on the H200.
                  "tf32x3" if query.dtype.itemsize == 4 else "tf32",
                  num_splits > 1, *quant, dense_kv, codes,
                  tl.float32 if interpreting() or query.dtype.itemsize == 4 else tl.bfloat16, int4_ptx(codes),
                  codes == 2 and launch_args.INT4_ROTATION == "butterfly",
                  codes == 2 and launch_args.INT4_PREFETCH)

    def launch(grid: tuple[int, int, int], role: int, shape: TileConfig):
        # The m/l strides (last two) are not specialized on: they stay out of the key. The
        # descriptors' specialization (dtype, block shape) follows from the caches' and the tiles'.
        args = (*tensors, *descriptors, *runtime, *strides, *ws_strides, *constexprs, role)
        key = (query.device.index, tensor_key(tensors), strides, ws_strides[:3], constexprs, role, tiles)
        return (_launch_attention, grid, args, key,
                {"num_warps": shape.num_warps, "num_stages": shape.num_stages})

    if int4_decode:
        plan = prelude + [gluon_int4_decode.decode_launch(
            query, kv_scales, slot_table, query_start_loc, seq_lens, scale * head_size, output, row_limit,
            num_splits, signs, (acc_ws, m_ws, l_ws), ws_strides)]
        if not decodes_only:
            plan.append(launch((num_tiles, num_kv_heads, num_splits), 2, tiles))
    elif tiles.short_launch is None:
        plan = [launch((num_tiles, num_kv_heads, num_splits), 0, tiles)]
    else:  # both write the same workspace (each request's rows belong to one), merged once below
        plan = prelude + [launch((num_requests, num_kv_heads, num_splits), 1, tiles.short_launch),
                launch((num_tiles, num_kv_heads, num_splits), 2, tiles)]
    if num_splits > 1:
        plan.append(merge_launch(acc_ws, m_ws, l_ws, output, query_start_loc, num_requests, row_limit,
                                 num_splits, ws_strides, head_size))
    return plan
