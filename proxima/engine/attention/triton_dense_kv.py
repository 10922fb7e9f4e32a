"""Dense-tile K/V reads for the attention kernel (``TileConfig.dense_kv``; issue 18): where the
slots one program reads are one ascending run, its K/V tiles are dense blocks of cache rows, read
through 2-D tensor descriptors (TMA on Hopper) instead of gathered token by token.

Layer: Triton device helpers that ``triton_query_tile._attend_query_tile`` calls, and the host
side that says whether a launch can have them and builds their descriptors. Not planned yet:
docs/benchmarks.md (contiguous slots and dense-tile reads) says why and how it is to be timed.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from proxima.engine.attention.planning import head_size_pad
from proxima.engine.attention.triton_softmax import _online_softmax_step


@triton.jit
def _slot_run_start(slot_row_ptr, first, num_keys, tile_start, tile_end, BLOCK_N: tl.constexpr):
    """Slot of position ``first`` when the slots of positions [first, num_keys) that tiles
    [tile_start, tile_end) cover ascend by one from it, else -1. Reads the entries the gather
    would read (4 bytes a position, against 2 x D x itemsize of K and V)."""
    run_start = tl.load(slot_row_ptr + first, mask=first < num_keys, other=-1).to(tl.int64)
    breaks = 0
    for tile in range(tile_start, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < num_keys
        slots = tl.load(slot_row_ptr + offs_n, mask=n_ok, other=0).to(tl.int64)
        breaks += tl.sum((n_ok & (slots != run_start + (offs_n - first))).to(tl.int32))
    return tl.where(breaks == 0, run_start, -1)


@triton.jit
def _attend_dense_kv_tiles(
    q, acc, l_i, m_i, k_desc, v_desc, k_column, v_column, slot_of_position_0, num_keys, q_abs_pos,
    qk_scale, tile_start, tile_end,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr,
):
    """``_attend_kv_tiles`` over a context whose slots are one ascending run: each K/V tile is one
    dense block of cache rows, loaded through a tensor descriptor (TMA on Hopper) with no
    per-token address. ``MASKED`` False: tiles every row sees whole (no mask, as FlashAttention
    splits its loop). ``MASKED``: the causal mask, and rows past the run (positions >= num_keys:
    other slots or, past the cache's end, zeros) out of the logits and their V rows zeroed, as
    they may hold anything."""
    for tile in range(tile_start, tile_end):
        row = (slot_of_position_0 + tile * BLOCK_N).to(tl.int32)
        k = k_desc.load([row, k_column])  # [BLOCK_N, D]
        s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * qk_scale
        v = v_desc.load([row, v_column]).to(DOT_DTYPE)
        if MASKED:
            offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
            s = tl.where(offs_n[None, :] <= q_abs_pos[:, None], s, float("-inf"))
            v = tl.where((offs_n < num_keys)[:, None], v, 0.0).to(DOT_DTYPE)
        p, alpha, l_i, m_new = _online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


def dense_kv_ok(query: Tensor, k_cache: Tensor, v_cache: Tensor, head_size: int) -> bool:
    """Whether the caches can be read through 2-D tensor descriptors (rows = slots): an unpadded
    power-of-two head, 16-bit storage as the queries', and the 16-byte alignment TMA needs of the
    base and the row stride."""
    if head_size != head_size_pad(head_size) or k_cache.dtype != query.dtype or query.dtype.itemsize != 2:
        return False
    return all(c.data_ptr() % 16 == 0 and c.stride(0) * c.element_size() % 16 == 0 and c.stride(2) == 1
               for c in (k_cache, v_cache))


def kv_descriptors(k_cache: Tensor, v_cache: Tensor, block_n: int, head_size: int) -> tuple:
    """K and V as [slots, columns] descriptors whose [block_n, D] blocks start at column
    ``kv_head * head stride``: any layout with unit stride along D (K and V halves of one row
    too), each descriptor spanning its own cache's columns only."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return tuple(
        TensorDescriptor(c, shape=[c.shape[0], (c.shape[1] - 1) * c.stride(1) + head_size],
                         strides=[c.stride(0), 1], block_shape=[block_n, head_size])
        for c in (k_cache, v_cache))
