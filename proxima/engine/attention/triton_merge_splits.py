"""Split-KV merge: the second launch of a split attention call (``triton_attention``'s docstring
has the design). Each split program stored unnormalised ``(acc, m, l)`` rows in a float32
workspace; one program per (token, query head) combines the S partials with a log-sum-exp.
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from proxima.engine.attention.kernel_launch import CompiledLaunch, tensor_key
from proxima.engine.attention.planning import head_size_pad

# Arguments the attention kernels are not specialised on, so that no batch size, row limit or
# split count compiles a new variant (the m/l workspace strides are Hq*S and S).
UNSPECIALIZED = ("num_requests", "num_actual_tokens", "num_splits", "stride_ml_t", "stride_ml_h")


@triton.jit(do_not_specialize=UNSPECIALIZED)
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


_launch_merge = CompiledLaunch(_merge_splits_kernel)


def merge_launch(
    acc_ws: Tensor, m_ws: Tensor, l_ws: Tensor, output: Tensor, query_start_loc: Tensor,
    num_requests: int, row_limit: int, num_splits: int, ws_strides: tuple[int, ...], head_size: int,
) -> tuple[CompiledLaunch, tuple[int, int, int], tuple, tuple, dict]:
    """The merge's entry in an attention call's launch plan: (launcher, grid, args, key, options)."""
    padded = head_size_pad(head_size)
    splits_pad = triton.next_power_of_2(num_splits)
    tensors = (acc_ws, m_ws, l_ws, output, query_start_loc)
    strides = (output.stride(0), output.stride(1))
    constexprs = (head_size, padded, splits_pad)
    # The whole [S, D] block sits in registers: 8 warps once it passes 8K floats.
    num_warps = 4 if splits_pad * padded <= 8192 else 8
    return (_launch_merge, (output.shape[0], output.shape[1], 1),
            (*tensors, num_requests, row_limit, num_splits, *ws_strides, *strides, *constexprs),
            (output.device.index, tensor_key(tensors), ws_strides[:3], strides, constexprs, num_warps),
            {"num_warps": num_warps})
