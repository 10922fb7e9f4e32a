"""Triton KV write: each new token's K/V into its slot (fp8 caches quantised with the layer's scales).

The write half of the slot-attention contract (``slot_rows.write_kv`` is its torch twin and the
reference it is tested against); ``triton_attention`` holds the attention kernels. An fp8 cache
stores ``fp8(x / scale)`` saturated to the format's finite range, rounding to nearest even as
vLLM's CUDA writers do (``quant.py`` states the semantics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from proxima.engine.attention.checks import check_unit_stride, check_write_kv_args
from proxima.engine.attention.kernel_launch import CompiledLaunch, tensor_key
from proxima.engine.attention.launch_args import check_backend, interpreting, scale_args
from proxima.engine.attention.quant import KVScales


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
    check_backend(key, "write_kv_triton")
    num_rows = slot_mapping.shape[0]
    if num_rows == 0:
        return
    num_kv_heads, head_size = k_cache.shape[1], k_cache.shape[2]
    k_scale, v_scale, quant = scale_args(scales, k_cache)
    tensors = (key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    ints = (key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1))
    constexprs = (num_kv_heads, head_size, triton.next_power_of_2(num_kv_heads),
                  triton.next_power_of_2(head_size), *quant, *_fp8_grid_constants(k_cache.dtype))
    _launch_write_kv((num_rows, 1, 1), (*tensors, *ints, *constexprs),
                     (key.device.index, tensor_key(tensors), ints, constexprs))


def _fp8_grid_constants(dtype: torch.dtype) -> tuple[bool, int, float, float]:
    """(GRID_ROUNDING, MANTISSA_BITS, MIN_NORMAL, SUBNORMAL_MAGIC) of ``_write_kv_kernel``."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2) or not interpreting():
        return False, 0, 0.0, 0.0
    info = torch.finfo(dtype)
    mantissa_bits = 3 if dtype == torch.float8_e4m3fn else 2
    smallest_subnormal = info.smallest_normal * 2.0 ** -mantissa_bits
    return True, mantissa_bits, info.smallest_normal, smallest_subnormal * 2.0 ** 23
