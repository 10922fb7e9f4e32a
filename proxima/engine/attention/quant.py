"""fp8 KV cache: which dtypes Proxima stores, and how K/V are quantised into slots and read back.

Layer: the numeric contract shared by both attention implementations (``reference`` on CPU,
``triton_attention`` on CUDA) and by the backend that hands them a layer's scales. Semantics
are vLLM 0.26's per-tensor fp8 KV cache (``triton_reshape_and_cache_flash``, ``_cast_kv_tile``,
``quantization/kv_cache.py``), so one model gives the same cache in both engines:

- stored = fp8(x / scale), saturated to the format's finite range (vLLM's CUDA conversions are
  ``satfinite``; a plain torch cast would turn 449 into NaN in e4m3);
- read = float(stored) * scale;
- ``scale`` is the layer's ``_k_scale`` / ``_v_scale``: a float32 tensor of one element
  (per-tensor: a checkpoint's scale, or vLLM's 1.0 default with its warning) or of ``Hkv``
  elements (compressed-tensors' ``attn_head`` strategy, the per-head scales vLLM 0.26 has).
  Scales stay tensors on the cache's device: the CUDA kernels read them in-kernel, so nothing
  syncs the host and CUDA graphs replay whatever values the scales hold.

Rounding (measured, tests/test_attention_fp8.py pins both byte for byte): vLLM's CUDA and Triton
writers round to nearest even; vLLM's CPU writer (``cpu_attn_reshape_and_cache``) rounds toward
zero. Each Proxima path follows the vLLM backend it is compared with on that device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

# vLLM's fp8 names (``--kv-cache-dtype``) -> the element type stored; "fp8" means e4m3 in vLLM.
FP8_KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_STORAGE = tuple(sorted(set(FP8_KV_DTYPES.values()), key=str))

Rounding = Literal["nearest", "toward_zero"]


@dataclass(frozen=True, slots=True)
class KVScales:
    """A layer's K and V dequantisation scales: float32 tensors of 1 or ``Hkv`` elements."""

    k: Tensor
    v: Tensor


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_STORAGE


def storage_dtype(kv_cache_dtype: str) -> torch.dtype | None:
    """The fp8 element type for a ``--kv-cache-dtype`` value; None for "auto" (model dtype)."""
    return FP8_KV_DTYPES.get(kv_cache_dtype)


def head_scales(scale: Tensor, num_kv_heads: int) -> Tensor:
    """``[Hkv, 1]`` float32 view of a per-tensor or per-head scale (broadcasts over ``[.., Hkv, D]``)."""
    if scale.numel() not in (1, num_kv_heads):
        raise ValueError(
            f"fp8 KV cache: a scale has {scale.numel()} elements; expected 1 (per tensor) or "
            f"{num_kv_heads} (per KV head)"
        )
    return scale.reshape(-1, 1).float().expand(num_kv_heads, 1)


def quantize_fp8(x: Tensor, scale: Tensor, dtype: torch.dtype, rounding: Rounding = "nearest") -> Tensor:
    """``fp8(x / scale)`` of ``x [..., Hkv, D]``, saturated; float32 math whatever x's dtype."""
    finite = torch.finfo(dtype).max
    scaled = (x.float() / head_scales(scale, x.shape[-2])).clamp_(-finite, finite)
    quantized = scaled.to(dtype)  # round to nearest even
    if rounding == "toward_zero":
        # Where nearest rounded away from zero, step one code down in magnitude: sign-magnitude
        # formats order codes of one sign by magnitude, across exponent boundaries too.
        codes = quantized.view(torch.uint8)
        overshot = quantized.float().abs() > scaled.abs()
        quantized = torch.where(overshot, codes - 1, codes).view(dtype)
    return quantized


def dequantize(cache: Tensor, scale: Tensor) -> Tensor:
    """``float(stored) * scale`` of cache rows ``[..., Hkv, D]`` as float32."""
    return cache.float() * head_scales(scale, cache.shape[-2])
