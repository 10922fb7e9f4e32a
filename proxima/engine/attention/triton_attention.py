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
- the tile loop lives in ``_attend_kv_tiles`` and takes a ``[tile_start, tile_end)`` range.

Split-KV (flash-decoding), for launches whose grid is too small to fill the GPU (small batches
of long decodes: the grid is ~ requests x Hkv programs, each walking its whole context alone):

- the same kernel, compiled with ``SPLIT``, gets a third grid axis of ``num_splits`` programs per
  query tile; split ``s`` attends KV tiles ``[s*n // S, (s+1)*n // S)`` of the ``n`` its query
  tile can see, so segments are whole ``BLOCK_N`` tiles, balanced per request, computed in the
  kernel from the real ``seq_lens``. Segments never depend on the hint: a stale or missing
  ``max_seq_len`` (graph capture) costs speed only, and a split count above a request's tile
  count leaves empty segments, which store the neutral partial (m = -inf, l = 0);
- every program stores unnormalised ``(acc, m, l)`` per row into a float32 workspace sized from
  host-known numbers only (T, Hq, D, S), and ``_merge_splits_kernel`` combines the S partials of
  each (token, head) with a log-sum-exp into ``output``;
- one split count per launch applies to every tile, prefill tiles included: correctness never
  rests on the batch being decode-only, the kernel body stays one, and a short chunked prefill
  over a long context (few tiles) gains the same parallelism. Splits are only chosen when the
  grid is small, which keeps T small; a byte budget caps the workspace regardless.

fp8 caches (``quant.py`` states the semantics, vLLM's): ``_write_kv_kernel`` stores
``fp8(x / scale)`` saturated to the format's finite range, rounding to nearest even as vLLM's
CUDA writers do. The attention kernel loads fp8 K/V tiles and widens them exactly to the dot
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

import logging
import time
from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from proxima.engine.attention.checks import check_attention_args, check_unit_stride, check_write_kv_args
from proxima.engine.attention.launcher import CompiledLaunch, tensor_key
from proxima.engine.attention.planning import (
    MAX_SPLITS,
    SPLIT_WORKSPACE_BUDGET_BYTES,
    TileConfig,
    choose_num_splits,
    choose_tiles,
    longest_context,
    num_sms,
)
from proxima.engine.attention.quant import KVScales

_LOG2_E = 1.4426950408889634
# Arguments the attention kernels are not specialised on, so that no batch size, row limit or
# split count compiles a new variant (the m/l workspace strides are Hq*S and S).
_UNSPECIALIZED = ("num_requests", "num_actual_tokens", "num_splits", "stride_ml_t", "stride_ml_h")

# Under "vllm." so the line lands in the server log with vLLM's own handlers and format.
logger = logging.getLogger(f"vllm.{__name__}")


@triton.jit
def _on_fp8_grid(x, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr, SUBNORMAL_MAGIC: tl.constexpr):
    """float32 ``x`` (within the fp8 range) rounded to nearest even on the fp8 grid, as float32.

    Only under the interpreter: its float32 -> fp8 cast drops the carry when rounding reaches the
    next power of two (7.9 becomes 4.0 in e4m3), so the interpreter casts values already on the
    grid. GPUs round in the conversion itself (cvt.rn.satfinite), which is what vLLM relies on.
    """
    shift: tl.constexpr = 23 - MANTISSA_BITS
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) & -(1 << shift)
    normal = bits.to(tl.float32, bitcast=True)
    # Below the smallest normal the grid is uniform: adding and removing 2^23 ulps rounds to it.
    magnitude = tl.abs(x)
    subnormal = (magnitude + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC
    subnormal = tl.where(x < 0, -subnormal, subnormal)
    return tl.where(magnitude < MIN_NORMAL, subnormal, normal)


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr, k_scale_ptr, v_scale_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr,
    QUANT: tl.constexpr, SCALE_STRIDE: tl.constexpr, FP8_MAX: tl.constexpr,
    GRID_ROUNDING: tl.constexpr, MANTISSA_BITS: tl.constexpr, MIN_NORMAL: tl.constexpr,
    SUBNORMAL_MAGIC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + row).to(tl.int64)
    if slot < 0:  # padding token
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_SIZE_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_SIZE)
    k = tl.load(key_ptr + row * stride_key_t + heads * stride_key_h + dims, mask=mask)
    v = tl.load(value_ptr + row * stride_value_t + heads * stride_value_h + dims, mask=mask)
    if QUANT:
        # fp8(x / scale) in float32, saturated as vLLM's satfinite conversions are (a bare cast
        # would give NaN past the range under the interpreter); the store rounds to nearest even.
        head_ok = heads < NUM_KV_HEADS
        k_scale = tl.load(k_scale_ptr + heads * SCALE_STRIDE, mask=head_ok, other=1.0)
        v_scale = tl.load(v_scale_ptr + heads * SCALE_STRIDE, mask=head_ok, other=1.0)
        k = tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
        if GRID_ROUNDING:
            k = _on_fp8_grid(k, MANTISSA_BITS, MIN_NORMAL, SUBNORMAL_MAGIC)
            v = _on_fp8_grid(v, MANTISSA_BITS, MIN_NORMAL, SUBNORMAL_MAGIC)
    tl.store(k_cache_ptr + slot * stride_kc_s + heads * stride_kc_h + dims,
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + slot * stride_vc_s + heads * stride_vc_h + dims,
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


_launch_write_kv = CompiledLaunch(_write_kv_kernel)


def write_kv_triton(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    scales: KVScales | None = None,
) -> None:
    """Triton ``write_kv``: skips negative slots in-kernel (no host sync). Slots must be distinct
    and in range; out-of-range slots are not checked (that would sync). An fp8 cache takes its
    layer's ``scales`` and is written rounding to nearest even (vLLM's CUDA writers)."""
    check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, scales)
    check_unit_stride("write_kv_triton",
                      (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)))
    if not slot_mapping.is_contiguous():
        raise ValueError("write_kv_triton: slot_mapping must be contiguous")
    _check_backend(key, "write_kv_triton")
    num_rows = slot_mapping.shape[0]
    if num_rows == 0:
        return
    num_kv_heads, head_size = k_cache.shape[1], k_cache.shape[2]
    k_scale, v_scale, quant = _scale_args(scales, k_cache)
    tensors = (key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    ints = (key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    constexprs = (num_kv_heads, head_size, triton.next_power_of_2(num_kv_heads),
                  triton.next_power_of_2(head_size), *quant, *_fp8_grid_constants(k_cache.dtype))
    _launch_write_kv((num_rows, 1, 1), (*tensors, *ints, *constexprs),
                     (key.device.index, tensor_key(tensors), ints, constexprs))


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


@triton.jit
def _attend_kv_tiles(
    q, acc, l_i, m_i,
    k_head_ptr, v_head_ptr, slot_row_ptr, seq_len, q_abs_pos, qk_scale,
    stride_k_s, stride_v_s, tile_start, tile_end,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax of q ([BLOCK_M, D]) over KV tiles [tile_start, tile_end); base-2 logits."""
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    d_ok = offs_d < HEAD_SIZE
    for tile in range(tile_start, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        # Table entries at or past seq_len are garbage: masked, never dereferenced.
        slots = tl.load(slot_row_ptr + offs_n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(k_head_ptr + slots[None, :] * stride_k_s + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D, BLOCK_N]
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
        visible = n_ok[None, :] & (offs_n[None, :] <= q_abs_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # Rows that have seen nothing yet (padding rows) keep m = -inf; subtract 0 there, not -inf.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head_ptr + slots[:, None] * stride_v_s + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _slot_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, slot_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    acc_ws_ptr, m_ws_ptr, l_ws_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale, num_requests, num_actual_tokens, num_splits,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h,
    stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_table_r,
    stride_acc_t, stride_acc_h, stride_acc_s, stride_ml_t, stride_ml_h,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    QUANT: tl.constexpr, SCALE_STRIDE: tl.constexpr, FP8_MAX: tl.constexpr,
):
    """Unified (``SPLIT`` False: writes ``out``) or one KV segment (``SPLIT``: writes partials)."""
    tile_idx = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, tile_idx, num_requests, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_tile = tile_idx - (q_start // BLOCK_Q + req)
    if local_tile * BLOCK_Q >= q_len:  # surplus program, or a request with no queries
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    q_idx = local_tile * BLOCK_Q + offs_m // GROUP  # query index within the request
    head = kv_head * GROUP + offs_m % GROUP
    token = (q_start + q_idx).to(tl.int64)
    # offs_m < BLOCK_Q * GROUP drops the spare rows when GROUP is not a power of two.
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len) & (token < num_actual_tokens)
    d_ok = offs_d < HEAD_SIZE
    q = tl.load(q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)
    q_abs_pos = context + q_idx

    acc = tl.zeros([BLOCK_M, HEAD_SIZE_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    # Keys past the tile's last query position are masked for every row: do not visit them.
    num_keys = context + tl.minimum((local_tile + 1) * BLOCK_Q, q_len)
    num_kv_tiles = tl.cdiv(num_keys, BLOCK_N)
    if SPLIT:
        # Balanced whole-tile segments of this tile's own range: lengths differ by at most one
        # tile, and splits beyond num_kv_tiles get an empty range.
        split = tl.program_id(2)
        tile_start = split * num_kv_tiles // num_splits
        tile_end = (split + 1) * num_kv_tiles // num_splits
    else:
        tile_start = 0
        tile_end = num_kv_tiles
    slot_row_ptr = slot_table_ptr + req.to(tl.int64) * stride_table_r
    if QUANT:  # q . (k_scale * K) == (qk_scale * k_scale) * (q . K): no tile is rescaled
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head * SCALE_STRIDE)
    acc, l_i, m_i = _attend_kv_tiles(
        q, acc, l_i, m_i,
        k_ptr + kv_head * stride_k_h, v_ptr + kv_head * stride_v_h, slot_row_ptr, seq_len, q_abs_pos,
        qk_scale, stride_k_s, stride_v_s, tile_start, tile_end,
        HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
    )
    if QUANT:  # P (v_scale * V) == v_scale * (P V); partials too, so the merge stays as is
        acc = acc * tl.load(v_scale_ptr + kv_head * SCALE_STRIDE)
    if SPLIT:
        # m and l always (an empty segment's -inf / 0 is what tells the merge to skip it); acc
        # only when something was read, so empty segments cost two stores per row.
        ml = token * stride_ml_t + head * stride_ml_h + split
        tl.store(m_ws_ptr + ml, m_i, mask=row_ok)
        tl.store(l_ws_ptr + ml, l_i, mask=row_ok)
        if tile_start < tile_end:
            row = token * stride_acc_t + head * stride_acc_h + split * stride_acc_s
            tl.store(acc_ws_ptr + row[:, None] + offs_d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=_UNSPECIALIZED)
def _merge_splits_kernel(
    acc_ws_ptr, m_ws_ptr, l_ws_ptr, out_ptr, query_start_loc_ptr,
    num_requests, num_actual_tokens, num_splits,
    stride_acc_t, stride_acc_h, stride_acc_s, stride_ml_t, stride_ml_h, stride_o_t, stride_o_h,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """``output[t, h]`` = log-sum-exp merge of the split partials of one (token, head)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    # Exactly the rows the unified kernel writes: every row in [qsl[0], qsl[R]) belongs to a
    # request, cut at num_actual_tokens. Other rows' partials were never written (garbage).
    first = tl.load(query_start_loc_ptr)
    last = tl.minimum(tl.load(query_start_loc_ptr + num_requests), num_actual_tokens)
    if (token < first) | (token >= last):
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    ml = token * stride_ml_t + head * stride_ml_h + offs_s
    maxes = tl.load(m_ws_ptr + ml, mask=offs_s < num_splits, other=float("-inf"))
    sums = tl.load(l_ws_ptr + ml, mask=offs_s < num_splits, other=0.0)
    m_max = tl.max(maxes, 0)
    weight = tl.exp2(maxes - tl.where(m_max > float("-inf"), m_max, 0.0))  # 0 for empty segments
    # An empty segment's acc was never stored: it must not be loaded, not merely weighted 0.
    seen = maxes > float("-inf")
    row = token * stride_acc_t + head * stride_acc_h + offs_s * stride_acc_s
    acc = tl.load(acc_ws_ptr + row[:, None] + offs_d[None, :],
                  mask=seen[:, None] & (offs_d < HEAD_SIZE)[None, :], other=0.0)
    num = tl.sum(acc * weight[:, None], 0)
    den = tl.sum(sums * weight, 0)
    out = num / tl.where(den > 0.0, den, 1.0)
    tl.store(out_ptr + token * stride_o_t + head * stride_o_h + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_SIZE)


_launch_attention = CompiledLaunch(_slot_attention_kernel)
_launch_merge = CompiledLaunch(_merge_splits_kernel)


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
    kv_scales: KVScales | None = None,
) -> Tensor:
    """Triton ``slot_attention_torch``: same signature, same semantics, writes ``output`` in place.

    ``max_query_len`` / ``max_seq_len`` are optional host-side hints (vLLM's metadata has them):
    they pick tile shapes and the split-KV count, and never change the result, so a stale hint
    costs speed, not correctness. Without ``max_seq_len``, or while a CUDA graph is being
    captured (the graph replays with other lengths), the slot table width stands in for it.

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
    _check_backend(query, "slot_attention_triton")

    num_tokens, num_requests = query.shape[0], query_start_loc.shape[0] - 1
    if num_requests == 0 or num_tokens == 0:
        return output
    tiles, num_splits = choose_launch_shape(query, k_cache, slot_table, query_start_loc, max_query_len,
                                            max_seq_len)
    row_limit = num_tokens if num_actual_tokens is None else num_actual_tokens
    for launch, grid, args, key, options in _launch_plan(
        query, k_cache, v_cache, slot_table, query_start_loc, seq_lens, scale, output, row_limit, tiles,
        num_splits, kv_scales,
    ):
        launch(grid, args, key, **options)
    return output


def choose_launch_shape(
    query: Tensor, k_cache: Tensor, slot_table: Tensor, query_start_loc: Tensor,
    max_query_len: int | None, max_seq_len: int | None, tiles: TileConfig | None = None,
) -> tuple[TileConfig, int]:
    """Tile shape and split-KV count of a `slot_attention_triton` call with these arguments.

    ``tiles`` forces the shape (the GPU sweeps time shapes the planner would not pick), leaving the
    split count to the planner."""
    num_tokens, num_query_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[1]
    num_requests = query_start_loc.shape[0] - 1
    group = num_query_heads // num_kv_heads
    if tiles is None:
        tiles = choose_tiles(num_tokens, num_requests, group, _head_size_pad(head_size), query.dtype.itemsize,
                             max_query_len)
    # Real tiles number at most T (each holds a token): the tighter estimate for a decode batch.
    num_tiles = _grid_tiles(num_tokens, num_requests, tiles.block_m // group)
    num_splits = choose_num_splits(min(num_tiles, num_tokens) * num_kv_heads,
                                   triton.cdiv(longest_context(slot_table, max_seq_len), tiles.block_n),
                                   num_sms(query.device))
    if not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(
            f"slot_attention_triton: choose_num_splits gave {num_splits!r}; it must be an int >= 1"
        )
    bytes_per_split = num_tokens * num_query_heads * (head_size + 2) * 4
    return tiles, min(num_splits, max(1, SPLIT_WORKSPACE_BUDGET_BYTES // bytes_per_split))


def _head_size_pad(head_size: int) -> int:
    # A power of two for tl.arange, and at least tl.dot's 16.
    return max(16, triton.next_power_of_2(head_size))


def _grid_tiles(num_tokens: int, num_requests: int, block_q: int) -> int:
    # Request r's tiles start at query_start_loc[r] // block_q + r, and every tile index is below
    # query_start_loc[R] // block_q + R <= T // block_q + R: an upper bound from shapes alone.
    return num_tokens // block_q + num_requests


def _launch_plan(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, scale: float, output: Tensor, row_limit: int, tiles: TileConfig, num_splits: int,
    kv_scales: KVScales | None = None,
) -> list[tuple[CompiledLaunch, tuple[int, int, int], tuple, tuple, dict]]:
    """The kernel launches of one attention call: (launcher, grid, args, cache key, options) each.

    One place builds them for both the launch and `compile_attention_variants`, so a warmed-up
    variant is exactly the one a later call looks up.
    """
    num_tokens, num_query_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[1]
    num_requests = query_start_loc.shape[0] - 1
    group = num_query_heads // num_kv_heads
    head_size_pad = _head_size_pad(head_size)
    block_q = tiles.block_m // group
    num_tiles = _grid_tiles(num_tokens, num_requests, block_q)
    if num_splits == 1:
        # Placeholders: the unified kernel compiles every use of the workspace away.
        acc_ws, m_ws, l_ws, ws_strides = output, output, output, (0,) * 5
    else:
        acc_ws, m_ws, l_ws = _split_workspace(num_tokens, num_query_heads, num_splits, head_size,
                                              query.device)
        ws_strides = (*acc_ws.stride()[:3], *m_ws.stride()[:2])
    k_scale, v_scale, quant = _scale_args(kv_scales, k_cache)
    # Launch arguments in the kernel's parameter order, constexprs last (see launcher.py).
    tensors = (query, k_cache, v_cache, output, slot_table, query_start_loc, seq_lens, acc_ws, m_ws, l_ws,
               k_scale, v_scale)
    runtime = (float(scale) * _LOG2_E, num_requests, row_limit, num_splits)  # not specialized on
    strides = (query.stride(0), query.stride(1), output.stride(0), output.stride(1),
               k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
               slot_table.stride(0))
    constexprs = (head_size, head_size_pad, group, block_q, tiles.block_m, tiles.block_n,
                  _dot_dtype(query.dtype),
                  # fp32 storage would otherwise be multiplied in TF32 (10-bit mantissa); 3xTF32
                  # kept fp32-level error (3e-7 vs 3e-7 for "ieee") at 2-30x the speed on the H200.
                  "tf32x3" if query.dtype.itemsize == 4 else "tf32",
                  num_splits > 1, *quant)
    # The m/l strides (last two) are not specialized on: they stay out of the key.
    plan = [(_launch_attention, (num_tiles, num_kv_heads, num_splits),
             (*tensors, *runtime, *strides, *ws_strides, *constexprs),
             (query.device.index, tensor_key(tensors), strides, ws_strides[:3], constexprs, tiles),
             {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})]
    if num_splits > 1:
        splits_pad = triton.next_power_of_2(num_splits)
        tensors = (acc_ws, m_ws, l_ws, output, query_start_loc)
        strides = (output.stride(0), output.stride(1))
        constexprs = (head_size, head_size_pad, splits_pad)
        # The whole [S, D] block sits in registers: 8 warps once it passes 8K floats.
        num_warps = 4 if splits_pad * head_size_pad <= 8192 else 8
        plan.append((_launch_merge, (num_tokens, num_query_heads, 1),
                     (*tensors, num_requests, row_limit, num_splits, *ws_strides, *strides, *constexprs),
                     (query.device.index, tensor_key(tensors), ws_strides[:3], strides, constexprs,
                      num_warps),
                     {"num_warps": num_warps}))
    return plan


def compile_attention_variants(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, output: Tensor, kv_scales: KVScales | None = None,
) -> int:
    """Compile, without launching, every kernel variant later calls with these tensors may need.

    Why: Triton compiles a variant at its first launch, and vLLM's own warm-up reaches only some
    of them: on the H200 (scripts/gpu/serve_bench.sh) vLLM's JIT monitor caught
    `_slot_attention_kernel` compiling under the first requests of `proxima serve`, whose TTFT
    p95 was 970 ms against stock's 200; with this warm-up (10 variants, 4.2 s at start-up) it
    caught none. The variants: decode and prefill tile shapes, each unsplit and
    split, and the merge kernel for every padded split count the slot table width allows.
    Nothing is launched, so this is safe anywhere but inside a CUDA-graph capture (the caller
    skips it there). Returns the number of variants compiled or loaded from Triton's disk cache.
    """
    num_tokens, num_query_heads, head_size = query.shape
    group = num_query_heads // k_cache.shape[1]
    head_size_pad = _head_size_pad(head_size)

    def plan(tiles: TileConfig, num_splits: int):
        # A one-token call: variants depend on dtypes, alignment, strides and constexprs, not sizes.
        return _launch_plan(query[:1], k_cache, v_cache, slot_table, query_start_loc[:2], seq_lens[:1], 1.0,
                            output[:1], 1, tiles, num_splits, kv_scales)

    max_splits = 1
    count = 0
    for max_query_len in (1, 2):  # decode-only tiles, then prefill tiles
        tiles = choose_tiles(num_tokens, query_start_loc.shape[0] - 1, group, head_size_pad,
                             query.dtype.itemsize, max_query_len)
        kv_tiles = triton.cdiv(slot_table.shape[1], tiles.block_n)
        max_splits = max(max_splits, min(MAX_SPLITS, kv_tiles))
        for num_splits in (1, 2):  # every split count > 1 shares one main-kernel variant
            for launch, grid, args, key, options in plan(tiles, num_splits):
                count += launch.compile(grid, args, key, **options)
    # The merge kernel is compiled per padded split count (a constexpr).
    tiles = choose_tiles(1, 1, group, head_size_pad, query.dtype.itemsize, 1)
    splits = 4
    while splits <= triton.next_power_of_2(max_splits):
        _, (launch, grid, args, key, options) = plan(tiles, splits)
        count += launch.compile(grid, args, key, **options)
        splits *= 2
    return count


_precompiled_layouts: set[tuple] = set()


def precompile_attention_once(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, output: Tensor, kv_scales: KVScales | None = None,
) -> bool:
    """`compile_attention_variants` once per tensor layout (all layers of a model share one).

    Returns False, doing nothing, inside a CUDA-graph capture (the caller tries again on a later
    call) and under the interpreter (nothing to compile); True once the variants are ready.
    """
    if _interpreting():
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    layout = (query.device.index, query.dtype, tuple(query.shape[1:]), query.stride(), tuple(k_cache.shape),
              k_cache.dtype, k_cache.stride(), v_cache.stride(), slot_table.stride(), tuple(output.shape[1:]),
              output.stride(), _scale_args(kv_scales, k_cache)[2])
    if layout not in _precompiled_layouts:
        start = time.perf_counter()
        count = compile_attention_variants(query, k_cache, v_cache, slot_table, query_start_loc, seq_lens,
                                           output, kv_scales)
        _precompiled_layouts.add(layout)
        logger.info("Proxima: %d attention kernel variants compiled or loaded in %.1f s", count,
                    time.perf_counter() - start)
    return True


def _scale_args(scales: KVScales | None, k_cache: Tensor) -> tuple[Tensor, Tensor, tuple[bool, int, float]]:
    """Scale pointers and the (QUANT, SCALE_STRIDE, FP8_MAX) constexprs of a launch.

    Without scales the cache itself stands in for both pointers (never read: QUANT compiles the
    loads away). A scale of one element is read at stride 0 by every KV head, per-head scales at 1.
    """
    if scales is None:
        return k_cache, k_cache, (False, 0, 0.0)
    per_head = scales.k.numel() > 1
    if per_head != (scales.v.numel() > 1):
        raise ValueError("slot attention: k_scale and v_scale must both be per tensor or both per head")
    if per_head and (scales.k.stride(-1) != 1 or scales.v.stride(-1) != 1):
        raise ValueError("slot attention: per-head scales must be contiguous")
    return scales.k, scales.v, (True, int(per_head), float(torch.finfo(k_cache.dtype).max))


def _fp8_grid_constants(dtype: torch.dtype) -> tuple[bool, int, float, float]:
    """(GRID_ROUNDING, MANTISSA_BITS, MIN_NORMAL, SUBNORMAL_MAGIC) of ``_write_kv_kernel``."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not _interpreting():
        return False, 0, 0.0, 0.0
    info = torch.finfo(dtype)
    mantissa_bits = 3 if dtype == torch.float8_e4m3fn else 2
    smallest_subnormal = info.smallest_normal * 2.0 ** -mantissa_bits
    return True, mantissa_bits, info.smallest_normal, smallest_subnormal * 2.0 ** 23


def _split_workspace(
    num_tokens: int, num_heads: int, num_splits: int, head_size: int, device: torch.device
) -> tuple[Tensor, Tensor, Tensor]:
    """Float32 partials ``acc [T, Hq, S, D]``, ``m [T, Hq, S]``, ``l [T, Hq, S]`` (S contiguous).

    Sizes are host-known, so this is graph-capturable (inside a capture it comes from the
    graph's pool). One allocation, as it runs per layer per step; uninitialised on purpose: the
    merge reads only partials written first.
    """
    rows = num_tokens * num_heads * num_splits
    # Each partial starts 16-byte aligned (4 floats) whatever T, Hq, S and D are: Triton
    # specializes a pointer on its alignment, and an odd size would otherwise compile another
    # kernel variant mid-serving, one the warm-up cannot foresee.
    acc_floats, ml_rows = triton.cdiv(rows * head_size, 4) * 4, triton.cdiv(rows, 4) * 4
    buffer = torch.empty(acc_floats + 2 * ml_rows, dtype=torch.float32, device=device)
    acc = buffer[: rows * head_size].view(num_tokens, num_heads, num_splits, head_size)
    ml = buffer[acc_floats:].view(2, ml_rows)[:, :rows]
    maxes, sums = (part.view(num_tokens, num_heads, num_splits) for part in ml.unbind(0))
    return acc, maxes, sums


def _dot_dtype(storage: torch.dtype) -> tl.dtype:
    """Operand dtype of the tensor-core dots: the storage dtype, except bf16 under the interpreter.

    The interpreter keeps bf16 as uint16 and its tl.dot multiplies the raw bit patterns
    (triton-lang/triton#11584, unsupported upstream), so there bf16 operands are widened to fp32.
    """
    if storage == torch.bfloat16:
        return tl.float32 if _interpreting() else tl.bfloat16
    return tl.float16 if storage == torch.float16 else tl.float32


@cache  # fixed when this module's kernels were decorated; asked per layer per step (bf16)
def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_slot_attention_kernel, InterpretedFunction)


def _check_backend(t: Tensor, who: str) -> None:
    if t.device.type != "cuda" and not _interpreting():
        raise ValueError(
            f"{who}: tensors are on {t.device}; Triton needs CUDA, or TRITON_INTERPRET=1 set before "
            f"Triton is imported (or use the torch implementation in reference.py)"
        )
