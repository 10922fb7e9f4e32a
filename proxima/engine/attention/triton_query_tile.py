"""One program's work in ``triton_attention._slot_attention_kernel``: a query tile of one request
and one KV head, over its range of KV tiles.

Layer: Triton device functions only; the kernel and its host launcher are in ``triton_attention``
(whose docstring gives the design: tiles, split-KV, fp8 scales), the int4 tile loop in
``triton_int4``, the dense (descriptor) reads in ``triton_dense_kv``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from proxima.engine.attention.triton_dense_kv import _attend_dense_kv_tiles, _slot_run_start
from proxima.engine.attention.triton_int4 import _attend_int4_tiles, _rotate_queries, _unrotate
from proxima.engine.attention.triton_softmax import _online_softmax_step


@triton.jit
def _attend_kv_tiles(
    q, acc, l_i, m_i,
    k_head_ptr, v_head_ptr, slot_row_ptr, seq_len, q_abs_pos, qk_scale,
    stride_k_s, stride_v_s, tile_start, tile_end,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ks_head_ptr=None, vs_head_ptr=None, stride_ks_s=0, KV_CODES: tl.constexpr = 0,
):
    """Online softmax of q ([BLOCK_M, D]) over KV tiles [tile_start, tile_end); base-2 logits.

    ``KV_CODES`` 1 (int8 and fp8 per-token-head caches, ``per_token_head.py``): K/V are codes with
    a float32 scale per (slot, head) at ``ks_head_ptr`` / ``vs_head_ptr``, applied to the scores'
    columns and to P's columns, never to a tile. (int4 has a loop of its own: ``triton_int4``.)"""
    offs_d = tl.arange(0, HEAD_SIZE_PAD)
    d_ok = offs_d < HEAD_SIZE
    for tile in range(tile_start, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < seq_len
        # Table entries at or past seq_len are garbage: masked, never dereferenced.
        slots = tl.load(slot_row_ptr + offs_n, mask=n_ok, other=0).to(tl.int64)
        k = tl.load(k_head_ptr + slots[None, :] * stride_k_s + offs_d[:, None],
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [D, BLOCK_N]
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        if KV_CODES == 0:
            s = s * qk_scale
        else:
            k_scale = tl.load(ks_head_ptr + slots * stride_ks_s, mask=n_ok, other=0.0)
            s = s * (k_scale * qk_scale)[None, :]
        visible = n_ok[None, :] & (offs_n[None, :] <= q_abs_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        p, alpha, l_i, m_new = _online_softmax_step(s, m_i, l_i)
        v = tl.load(v_head_ptr + slots[:, None] * stride_v_s + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, D]
        if KV_CODES != 0:  # l_i took P unscaled above: P's columns carry V's scales from here on
            p = p * tl.load(vs_head_ptr + slots * stride_ks_s, mask=n_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_query_tile(
    q_ptr, k_ptr, v_ptr, out_ptr, slot_row_ptr, acc_ws_ptr, m_ws_ptr, l_ws_ptr, k_scale_ptr, v_scale_ptr,
    rht_ptr, signs_ptr,
    k_desc, v_desc, qk_scale, num_actual_tokens, num_splits, q_start, q_len, seq_len, local_tile, kv_head,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h,
    stride_ks_s, stride_ks_h, stride_acc_t, stride_acc_h, stride_acc_s, stride_ml_t, stride_ml_h,
    HEAD_SIZE: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    QUANT: tl.constexpr, SCALE_STRIDE: tl.constexpr, DENSE_KV: tl.constexpr,
    KV_CODES: tl.constexpr, ROT_DTYPE: tl.constexpr, INT4_PTX: tl.constexpr, ROT_BUTTERFLY: tl.constexpr,
    INT4_PREFETCH: tl.constexpr,
):
    """Query tile ``local_tile`` (``BLOCK_Q`` tokens x the GQA group) of one request, one KV head.

    ``DENSE_KV``: when the slots this program reads are one ascending run (checked here, on the
    GPU), K/V tiles come through the tensor descriptors instead of the per-token gather.
    ``KV_CODES`` 2 (int4): queries are rotated on load and the accumulator rotated back before
    it is stored, so partials, the merge and the output are in the natural space; ``INT4_PTX``
    (a compiled build): its codes are unpacked with inline PTX."""
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
    q_sum = None
    if KV_CODES == 2:
        q, q_sum = _rotate_queries(q, rht_ptr, signs_ptr, HEAD_SIZE_PAD, q_ptr.dtype.element_ty, DOT_DTYPE,
                                   DOT_PRECISION, ROT_BUTTERFLY)

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
    if QUANT:  # q . (k_scale * K) == (qk_scale * k_scale) * (q . K): no tile is rescaled
        qk_scale = qk_scale * tl.load(k_scale_ptr + kv_head * SCALE_STRIDE)
    gather = True
    if DENSE_KV:  # a constexpr branch: the served variants compile none of this
        run_start = _slot_run_start(slot_row_ptr, tile_start * BLOCK_N, num_keys, tile_start, tile_end,
                                    BLOCK_N)
        if run_start >= 0:
            # Tiles wholly at or before the first query's position need no mask.
            whole_end = tl.maximum(tl.minimum(tile_end, (context + local_tile * BLOCK_Q + 1) // BLOCK_N),
                                   tile_start)
            position_0 = run_start - tile_start * BLOCK_N
            acc, l_i, m_i = _attend_dense_kv_tiles(
                q, acc, l_i, m_i, k_desc, v_desc, kv_head * stride_k_h, kv_head * stride_v_h, position_0,
                num_keys, q_abs_pos, qk_scale, tile_start, whole_end, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
                False,
            )
            acc, l_i, m_i = _attend_dense_kv_tiles(
                q, acc, l_i, m_i, k_desc, v_desc, kv_head * stride_k_h, kv_head * stride_v_h, position_0,
                num_keys, q_abs_pos, qk_scale, whole_end, tile_end, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
                True,
            )
        else:
            acc, l_i, m_i = _attend_kv_tiles(
                q, acc, l_i, m_i,
                k_ptr + kv_head * stride_k_h, v_ptr + kv_head * stride_v_h, slot_row_ptr, seq_len,
                q_abs_pos, qk_scale, stride_k_s, stride_v_s, tile_start, tile_end,
                HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
            )
        gather = False
    if KV_CODES == 2:
        acc, l_i, m_i = _attend_int4_tiles(
            q, q_sum, acc, l_i, m_i,
            k_ptr + kv_head * stride_k_h, v_ptr + kv_head * stride_v_h, k_scale_ptr + kv_head * stride_ks_h,
            v_scale_ptr + kv_head * stride_ks_h, slot_row_ptr, seq_len, q_abs_pos, qk_scale, stride_k_s,
            stride_v_s, stride_ks_s, tile_start, tile_end, HEAD_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
            INT4_PTX, INT4_PREFETCH,
        )
    elif gather:
        acc, l_i, m_i = _attend_kv_tiles(
            q, acc, l_i, m_i,
            k_ptr + kv_head * stride_k_h, v_ptr + kv_head * stride_v_h, slot_row_ptr, seq_len, q_abs_pos,
            qk_scale, stride_k_s, stride_v_s, tile_start, tile_end,
            HEAD_SIZE, HEAD_SIZE_PAD, BLOCK_N, DOT_DTYPE, DOT_PRECISION,
            k_scale_ptr + kv_head * stride_ks_h, v_scale_ptr + kv_head * stride_ks_h, stride_ks_s, KV_CODES,
        )
    if KV_CODES == 2:
        acc = _unrotate(acc, rht_ptr, signs_ptr, HEAD_SIZE_PAD, ROT_DTYPE, DOT_PRECISION, ROT_BUTTERFLY)
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
