"""Host-side arguments of the Triton attention and KV-write launches, and the checks behind them.

Layer: between the launchers (``triton_attention``, ``triton_write_kv``) and torch/Triton. Pure
functions of tensors' shapes, dtypes and strides: nothing here reads device memory, so all of it
is valid inside a CUDA-graph capture.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from torch import Tensor

from proxima.engine.attention.per_token_head import PTHCache, rht_matrices
from proxima.engine.attention.quant import KVScales
from proxima.engine.settings import int4_decode_from_env


@triton.jit
def _probe():
    """Decorated like the kernels, to tell whether they run under the interpreter."""
    pass


def scale_args(
    scales: KVScales | PTHCache | None, k_cache: Tensor,
) -> tuple[Tensor, Tensor, tuple[bool, int, float]]:
    """Scale pointers and the (QUANT, SCALE_STRIDE, FP8_MAX) constexprs of a launch.

    Without scales the cache itself stands in for both pointers (never read: QUANT compiles the
    loads away). A scale of one element is read at stride 0 by every KV head, per-head scales at 1.
    A per-token-head cache's scale views are read per slot (``code_args``), QUANT stays off.
    """
    if scales is None:
        return k_cache, k_cache, (False, 0, 0.0)
    if isinstance(scales, PTHCache):
        return scales.k_scales, scales.v_scales, (False, 0, 0.0)
    per_head = scales.k.numel() > 1
    if per_head != (scales.v.numel() > 1):
        raise ValueError("slot attention: k_scale and v_scale must both be per tensor or both per head")
    if per_head and (scales.k.stride(-1) != 1 or scales.v.stride(-1) != 1):
        raise ValueError("slot attention: per-head scales must be contiguous")
    return scales.k, scales.v, (True, int(per_head), float(torch.finfo(k_cache.dtype).max))


# How int4 launches rotate queries and accumulators (vLLM's Walsh-Hadamard transform): "butterfly"
# (triton_int4._fwht, float32 stages in registers) or "matrix" (dots with the [D, D] matrix).
INT4_ROTATION = "butterfly"
# Whether int4 decode tiles pipeline their loads in registers (triton_int4._attend_int4_tiles_swapped).
# On the H100 (scripts/gpu/run.sh sweep-pth, graph-replayed mixed plan): 0.82-0.89x the time without
# at every decode point from 8 x 8,192 up.
INT4_PREFETCH = True
# Which kernel attends an int4 launch's decodes (requests of at most 8 rows: queries x GQA group):
# "gluon" (gluon_int4_decode, where it serves the shapes) or "triton" (the unified kernel's short
# tiles); the default and why: settings.DEFAULT_INT4_DECODE. PROXIMA_INT4_DECODE sets it for a whole
# server: read here and again by each int4 attention layer as its engine is built (backend.py), so
# that an in-process engine takes its spec's value, whatever was imported before; the benchmarks
# set it per call.
INT4_DECODE = int4_decode_from_env()


def code_args(
    scales: KVScales | PTHCache | None, query: Tensor,
) -> tuple[int, tuple[int, int], tuple[Tensor, Tensor]]:
    """KV_CODES (0: values, 1: int8/fp8 codes with per-(slot, head) scales, 2: int4), the scale
    views' (slot, head) strides, and int4's Hadamard matrix and signs (``query`` stands in for
    them otherwise: never read)."""
    if not isinstance(scales, PTHCache):
        return 0, (0, 0), (query, query)
    strides = scales.k_scales.stride()
    if scales.fmt.packed:
        return 2, strides, rht_matrices(scales.head_size, query.device)
    return 1, strides, (query, query)


def int4_ptx(codes: int) -> bool:
    """INT4_PTX: a compiled int4 launch unpacks its codes with inline PTX (``triton_int4._pair``);
    the interpreter runs no PTX, and takes the same arithmetic in Triton."""
    return codes == 2 and not interpreting()


def split_workspace(
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


def dot_dtype(storage: torch.dtype, cache: torch.dtype | None = None) -> tl.dtype:
    """Operand dtype of the tensor-core dots: the storage dtype, except bf16 under the interpreter,
    and fp16 over an fp8 cache on the GPU.

    The interpreter keeps bf16 as uint16 and its tl.dot multiplies the raw bit patterns
    (triton-lang/triton#11584, unsupported upstream), so there bf16 operands are widened to fp32.
    fp8 (e4m3 and e5m2) widen to fp16 in one instruction per pair (cvt.rn.f16x2.e4m3x2); bf16
    needs a second conversion per element (256 more per 128-token decode tile in the sm_90 PTX).
    Both fp8 formats' finite values are exact in fp16, and the bf16 queries are converted once per
    program; fp16's range (65,504) bounds the queries, which post-projection activations stay far
    inside.
    """
    if cache in (torch.float8_e4m3fn, torch.float8_e5m2) and storage in (torch.bfloat16, torch.float16) \
            and not interpreting():
        return tl.float16
    if storage == torch.bfloat16:
        return tl.float32 if interpreting() else tl.bfloat16
    return tl.float16 if storage == torch.float16 else tl.float32


@cache  # fixed when Triton decorated the kernels (at import, from TRITON_INTERPRET); asked per call
def interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_probe, InterpretedFunction)


def check_backend(t: Tensor, who: str) -> None:
    if t.device.type != "cuda" and not interpreting():
        raise ValueError(
            f"{who}: tensors are on {t.device}; Triton needs CUDA, or TRITON_INTERPRET=1 set before "
            f"Triton is imported (or use the torch implementation in reference.py)"
        )
