"""The per-token-head KV write on CUDA: vLLM 0.26's own quantising kernels on Proxima's slot views.

Layer: ``per_token_head.write`` hands CUDA rows here (its torch twin writes elsewhere). The slot
is a block of one position, so vLLM's kernels write the bytes vLLM's writer writes; what this
module adds is how they are launched: int4 rows of bf16 models rotated in 4 kernels instead of
vLLM's 14 (``_rotated_pair``, same bits), batches padded off hadacore's faulty odd-chunk path
(``_even_hadamard_chunks``), and the kernels launched through their compiled handles
(``kernel_launch``). Skips negative slots in-kernel (no host sync): graph-capturable.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from proxima.engine.attention.per_token_head import PTHCache


def vllm_write(key: Tensor, value: Tensor, cache: PTHCache, slot_mapping: Tensor) -> None:
    """vLLM's own Triton writer on the slot views: the slot is a block of one position. Skips
    negative slots in-kernel (no host sync), so it is graph-capturable.

    vLLM's quantising kernels are launched as its writer launches them, through their compiled
    handles after the first launch (``kernel_launch``: a Triton launch's own host work is most of
    a small kernel's cost in steps run outside CUDA graphs). int4 rows are rotated first:
    ``_rotated_pair`` for bf16 rows where hadacore runs; otherwise vLLM's whole writer runs."""
    import triton
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import _PER_TOKEN_HEAD_QUANT_PARAMS

    if cache.fmt.packed:
        key, value, slot_mapping = _even_hadamard_chunks(key, value, slot_mapping)
        rotated = _rotated_pair(key, value)
        if rotated is not None:
            packed = triton.next_power_of_2(key.shape[2] // 2)
            _launch_vllm_writer("int4", rotated[0], rotated[1], cache, slot_mapping, (packed,), packed)
            return
    elif (params := _PER_TOKEN_HEAD_QUANT_PARAMS.get(cache.k_codes.dtype)) is not None:
        padded = triton.next_power_of_2(max(key.shape[2], value.shape[2]))
        tail = (padded, *params, cache.k_codes.dtype == torch.int8)  # ..., QUANT_MAX, QUANT_MIN, IS_INT_QUANT
        _launch_vllm_writer("per_token_head", key, value, cache, slot_mapping, tail, padded)
        return
    _vllm_whole_writer(key, value, cache, slot_mapping)


def _vllm_whole_writer(key: Tensor, value: Tensor, cache: PTHCache, slot_mapping: Tensor) -> None:
    """vLLM's writer as its backend calls it (int4: its own rotation chain first)."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_per_token_head_quant,
    )
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    views = (cache.k_codes, cache.v_codes, cache.k_scales, cache.v_scales)
    triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, *(t.unsqueeze(1) for t in views), slot_mapping,
        kv_quant_mode=get_kv_quant_mode(cache.fmt.name))


def _launch_vllm_writer(kernel: str, key: Tensor, value: Tensor, cache: PTHCache, slot_mapping: Tensor,
                        tail: tuple, width: int) -> None:
    """One launch of vLLM 0.26's quantising kernel ``kernel`` ("int4": ``_reshape_cache_int4_kernel``;
    "per_token_head": int8/fp8's ``_reshape_cache_per_token_head``) over K/V rows into the slot
    views (blocks of one position), with its grid, arguments and warps as vLLM's launchers give them
    (``_run_reshape_kernel``, ``triton_reshape_and_cache_flash_per_token_head_quant``). ``tail``:
    the constexprs after ``head_size_v``; ``width``: the padded row the warps are sized from."""
    from proxima.engine.attention.kernel_launch import tensor_key

    num_tokens, num_kv_heads, head_size = key.shape
    caches = (cache.k_codes.unsqueeze(1), cache.v_codes.unsqueeze(1))  # [S, 1, Hkv, C]: blocks of one
    scales = (cache.k_scales.unsqueeze(1), cache.v_scales.unsqueeze(1))
    tensors = (key, value, *caches, *scales, slot_mapping)
    ints = (key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            *caches[0].stride()[:3], *caches[1].stride()[:3], *scales[0].stride(), *scales[1].stride())
    constexprs = (1, head_size, value.shape[2], *tail)  # block_size, head_size, head_size_v, ...
    num_warps = min(16, max(1, width // 32))
    launch_key = (key.device.index, tensor_key(tensors), ints, constexprs, num_warps)
    _vllm_writer(kernel)((num_tokens, num_kv_heads, 1), (*tensors, *ints, *constexprs), launch_key,
                         num_warps=num_warps)


@functools.cache
def _vllm_writer(kernel: str):
    """The launcher of one of vLLM's quantising kernels, made once (vLLM and Triton imported on
    first use)."""
    from proxima.engine.attention.kernel_launch import CompiledLaunch

    if kernel == "int4":
        from vllm.v1.attention.ops.int4_per_token_head import _reshape_cache_int4_kernel as fn
    else:
        from vllm.v1.attention.ops.triton_reshape_and_cache_flash import _reshape_cache_per_token_head as fn
    return CompiledLaunch(fn)


def _rotated_pair(key: Tensor, value: Tensor) -> Tensor | None:
    """bf16 K and V rotated as vLLM 0.26's int4 writer rotates them before it quantises
    (``single_rht(x.float()).to(x.dtype)``), to the bit, in 4 kernels where its chain takes 14.

    vLLM's chain per tensor: to float32, times the signs, to bf16, its CUDA Hadamard kernel
    (hadacore: ``x @ H / sqrt(D)`` in bf16), to float32, times ``sqrt(D)``, back to bf16: seven
    launches, each paying the host's launch cost in steps that run outside CUDA graphs (the whole
    write took 343 us of host time a layer on an H100) and its minimum GPU time in every step.
    Here: bf16 times bf16 signs is the same bf16 (a sign flip is exact in both), hadacore gets the
    same rows, and an in-place bf16 multiply by ``sqrt(D)`` computes in float32 and rounds once to
    bf16, as float32 then ``.to`` does. Returns ``[2, T, Hkv, D]``, K then V; None where this does
    not apply (another dtype, no hadacore, a batch hadacore would pad): vLLM's chain then runs."""
    from vllm.v1.attention.ops import int4_per_token_head as vllm_int4

    d = key.shape[-1]
    if (key.dtype != torch.bfloat16 or value.dtype != torch.bfloat16 or value.shape != key.shape
            or key.numel() % 256 or d > 1 << 15 or not vllm_int4._hadacore_available()):
        return None
    from vllm import _custom_ops as ops

    pair = torch.empty((2, *key.shape), dtype=torch.bfloat16, device=key.device)
    signs = _bf16_signs(d, key.device)
    torch.mul(key, signs, out=pair[0])
    torch.mul(value, signs, out=pair[1])
    # One call for K and V: hadacore transforms each row of D values on its own, and an even number
    # of 256-value chunks (K's count, doubled) keeps it off the masked path that gets rows wrong
    # (`_even_hadamard_chunks`). In place: hadacore pads, and returns a copy, only when the values
    # are not whole chunks (the numel check above).
    ops.hadacore_transform(pair, inplace=True)
    return pair.mul_(d ** 0.5)


@functools.cache
def _bf16_signs(head_size: int, device: torch.device) -> Tensor:
    from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs

    return _get_rht_signs(head_size, 0, torch.device("cpu")).to(device=device, dtype=torch.bfloat16)


def _even_hadamard_chunks(key: Tensor, value: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Pad a batch with skipped rows (slot -1) to an even number of 256-value chunks per tensor.

    vLLM 0.26's int4 writer rotates with its CUDA Hadamard kernel (hadacore), which takes chunks
    of 256 values two to a warp. On an odd count above one (head size 256 with an odd number of
    (token, head) rows, 128 with rows = 2 mod 4, ...) its masked path leaves the last chunk's rows
    wrong in the writer: on an H100, in 9 of 10 shape x dtype cases, every repeat, where the same
    rows in an even batch come out right (docs/benchmarks.md; test:
    ``test_an_odd_chunk_batch_is_written_as_an_even_one``). Zero rows are cheap to rotate and the
    writer skips their slots; shapes stay static, so graph capture is unaffected. A model whose
    token holds a multiple of 512 K values (Llama-3-8B: 8 heads of 128) never pads."""
    pad = -key.shape[0] % _chunk_pair_tokens(key.shape[1] * key.shape[2], value.shape[1] * value.shape[2])
    if pad == 0:
        return key, value, slot_mapping
    return (torch.cat([key, key.new_zeros(pad, *key.shape[1:])]),
            torch.cat([value, value.new_zeros(pad, *value.shape[1:])]),
            torch.cat([slot_mapping, slot_mapping.new_full((pad,), -1)]))


@functools.cache
def _chunk_pair_tokens(key_values: int, value_values: int) -> int:
    """The fewest tokens whose K values, and whose V values, fill whole pairs of 256-value chunks
    (once per shape: the write runs per layer and step)."""
    return math.lcm(512 // math.gcd(512, key_values), 512 // math.gcd(512, value_values))
