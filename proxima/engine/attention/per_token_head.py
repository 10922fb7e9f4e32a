"""Per-token-head quantised KV caches in slots: vLLM 0.26's int8, fp8 and int4 formats, byte for byte.

Layer: the numeric contract of `--kv-cache-dtype {int8,fp8,int4}_per_token_head`, shared by the
backend (cache views, the write), the torch attention (``reference``: dequantise what it gathers)
and the Triton kernels (which dequantise inside the gather). Semantics and storage are vLLM 0.26's
(``v1/attention/ops/triton_reshape_and_cache_flash.py``, ``int4_per_token_head.py``,
``v1/kv_cache_interface.py``), so one model holds the same cache bytes in both engines:

- each (token, KV head) row of K (and of V) gets its own float32 scale: ``absmax / 127`` (int8,
  codes rounded half away from zero, clamped to [-128, 127]) or ``absmax / 448`` (fp8 e4m3,
  rounded to nearest even), at least 1e-6;
- int4: the row is first rotated by vLLM's randomized Hadamard transform (``single_rht``: signs,
  then an unnormalised Walsh-Hadamard transform) and rounded back to the model dtype, then
  quantised asymmetrically to 0..15: ``scale = max((max - min) / 15, 1e-6)``, zero point
  ``round(-min / scale)`` clamped to 0..15 and kept in the scale's 4 low mantissa bits; value
  ``2i`` in the low nibble of byte ``i``, value ``2i+1`` in the high nibble. Attention then runs
  in the rotated space: queries rotated the same way, softmax scale divided by D, and the output
  rotated back (``single_rht`` inverse, divided by D).

Slot layout (why): vLLM's TRITON_ATTN keeps, per (block, head, position), ``[K codes | K scale |
V codes | V scale]``; with one position per block that is one slot row of ``Hkv`` such records,
so a slot carries its own scales: prefix sharing, eviction and reuse need nothing new, and a
gather of a slot reads everything needed to dequantise it. Codes are ``D`` bytes (int8, fp8) or
``D / 2`` (int4); each scale is 4 bytes at a 4-byte aligned offset (D is a multiple of 8).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

_SCALE_BYTES = 4
_MIN_SCALE = 1e-6
FP8_MAX = 448.0


@dataclass(frozen=True, slots=True)
class PTHFormat:
    """One per-token-head format: how codes are stored and how they read back."""

    name: str
    code_dtype: torch.dtype  # int8, float8_e4m3fn, or uint8 (two int4 values per byte)

    @property
    def packed(self) -> bool:
        """int4: two values a byte, an asymmetric zero point, Hadamard-rotated rows."""
        return self.code_dtype == torch.uint8

    def code_bytes(self, head_size: int) -> int:
        return head_size // 2 if self.packed else head_size

    def record_bytes(self, head_size: int) -> int:
        """Bytes one (slot, KV head) record takes: K codes, K scale, V codes, V scale."""
        return 2 * (self.code_bytes(head_size) + _SCALE_BYTES)


PTH_FORMATS: dict[str, PTHFormat] = {
    "int8_per_token_head": PTHFormat("int8_per_token_head", torch.int8),
    "fp8_per_token_head": PTHFormat("fp8_per_token_head", torch.float8_e4m3fn),
    "int4_per_token_head": PTHFormat("int4_per_token_head", torch.uint8),
}


def pth_format(kv_cache_dtype: str) -> PTHFormat | None:
    return PTH_FORMATS.get(kv_cache_dtype)


@dataclass(frozen=True, slots=True)
class PTHCache:
    """Views of one layer's per-token-head cache: codes ``[S, Hkv, C]`` and scales ``[S, Hkv]``
    (float32), all over the one uint8 buffer vLLM allocated; ``rows`` is ``[S, Hkv * record]``."""

    fmt: PTHFormat
    head_size: int
    rows: Tensor
    k_codes: Tensor
    v_codes: Tensor
    k_scales: Tensor
    v_scales: Tensor
    # int4: the codes as int32 words ``[S, Hkv, D / 8]`` (records and offsets are 4-byte aligned),
    # what the Triton kernel reads; None otherwise. Made once: asked per layer per step.
    k_words: Tensor | None = None
    v_words: Tensor | None = None

    @property
    def num_slots(self) -> int:
        return self.rows.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.k_codes.shape[1]


def _words(codes: Tensor) -> Tensor:
    words = torch.empty(0, dtype=torch.int32, device=codes.device).set_(codes.untyped_storage())
    slot, head, _ = codes.stride()
    return words.as_strided((codes.shape[0], codes.shape[1], codes.shape[2] // 4), (slot // 4, head // 4, 1),
                            codes.storage_offset() // 4)


def cache_views(kv_cache: Tensor, fmt: PTHFormat, num_kv_heads: int, head_size: int) -> PTHCache:
    """Views of a layer's cache ``[S, 1, Hkv, record]`` (any 1-byte dtype, contiguous)."""
    if head_size % 8:
        raise ValueError(f"{fmt.name}: head size {head_size} is not a multiple of 8")
    record, codes = fmt.record_bytes(head_size), fmt.code_bytes(head_size)
    raw = kv_cache.view(torch.uint8)
    num_slots = raw.shape[0]
    if raw.numel() != num_slots * num_kv_heads * record or not raw.is_contiguous():
        raise ValueError(f"{fmt.name}: cache of shape {tuple(kv_cache.shape)} is not [S, 1, "
                         f"{num_kv_heads}, {record}] contiguous")
    rows = raw.view(num_slots, num_kv_heads * record)
    typed = raw.view(fmt.code_dtype)
    floats = torch.empty(0, dtype=torch.float32, device=raw.device).set_(raw.untyped_storage())
    base = raw.storage_offset()
    assert base % _SCALE_BYTES == 0 and record % _SCALE_BYTES == 0

    def code_view(offset: int) -> Tensor:
        return typed.as_strided((num_slots, num_kv_heads, codes), (num_kv_heads * record, record, 1),
                                base + offset)

    def scale_view(offset: int) -> Tensor:
        return floats.as_strided((num_slots, num_kv_heads), (num_kv_heads * record // 4, record // 4),
                                 (base + offset) // 4)

    half = codes + _SCALE_BYTES
    k_codes, v_codes = code_view(0), code_view(half)
    words = (_words(k_codes), _words(v_codes)) if fmt.packed else (None, None)
    return PTHCache(fmt, head_size, rows, k_codes, v_codes, scale_view(codes), scale_view(half + codes),
                    *words)


# -- the randomized Hadamard rotation of int4, as vLLM computes it --------------------------------

def rotate(x: Tensor) -> Tensor:
    """vLLM's forward RHT of ``x`` (last dim a power of two), rounded back to ``x``'s dtype."""
    return _single_rht(x.float()).to(x.dtype)


def unrotate(x: Tensor) -> Tensor:
    """The inverse: vLLM's ``single_rht(x, inverse=True) / D``, in float32."""
    return _single_rht(x.float(), inverse=True) / x.shape[-1]


def _single_rht(x: Tensor, inverse: bool = False) -> Tensor:
    """vLLM's `single_rht` in its CPU form (the butterfly below), on any device and in the input's
    precision. vLLM's own function sends every tensor to its CUDA Hadamard kernel on a CUDA machine,
    CPU ones too (which that kernel refuses), and rounds float32 to bf16 there; the writer on CUDA
    calls vLLM (its bytes), the torch attention and tests call this."""
    from vllm.v1.attention.ops.int4_per_token_head import _get_rht_signs

    signs = _get_rht_signs(x.shape[-1], 0, torch.device("cpu")).to(device=x.device, dtype=x.dtype)
    return _butterfly(x) * signs if inverse else _butterfly(x * signs)


def _butterfly(x: Tensor) -> Tensor:
    """vLLM's PyTorch Walsh-Hadamard butterfly (`fast_hadamard_transform`'s CPU tier)."""
    d, h = x.shape[-1], 1
    while h < d:
        xv = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = xv[..., 0, :], xv[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h <<= 1
    return x


@functools.cache
def rht_matrices(head_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """What the Triton kernels need to rotate in-kernel: vLLM's unnormalised Walsh-Hadamard
    matrix ``[D, D]`` (Sylvester order, float32) and its sign vector. Once per head size and device."""
    from vllm.v1.attention.ops.int4_per_token_head import _get_hadamard_matrix, _get_rht_signs

    hadamard = _get_hadamard_matrix(head_size, torch.float32, torch.device("cpu"))
    return (hadamard.contiguous().to(device),
            _get_rht_signs(head_size, 0, torch.device("cpu")).float().contiguous().to(device))


# -- quantise (the torch twin of vLLM's writers) and dequantise -------------------------------

def _round_half_away(x: Tensor) -> Tensor:
    """vLLM's ``where(x >= 0, int(x + 0.5), int(x - 0.5))`` (int() truncates), as float32."""
    return torch.where(x >= 0, x + 0.5, x - 0.5).trunc()


def quantize(x: Tensor, fmt: PTHFormat) -> tuple[Tensor, Tensor]:
    """Codes ``[T, Hkv, C]`` and float32 scales ``[T, Hkv]`` of rows ``x [T, Hkv, D]`` (model
    dtype), computed with the same float32 operations in the same order as vLLM's Triton writers."""
    if fmt.packed:
        return _quantize_int4(rotate(x).float())
    x = x.float()
    quant_max = 127.0 if fmt.code_dtype == torch.int8 else FP8_MAX
    scale = torch.clamp_min(x.abs().amax(-1) / quant_max, _MIN_SCALE)
    q = x * (1.0 / scale)[..., None]
    if fmt.code_dtype == torch.int8:
        q = torch.where(q >= 0, q + 0.5, q - 0.5)  # the int8 store then truncates
        return q.clamp(-128.0, 127.0).to(torch.int8), scale
    return q.clamp(-FP8_MAX, FP8_MAX).to(fmt.code_dtype), scale  # round to nearest even


def _quantize_int4(x: Tensor) -> tuple[Tensor, Tensor]:
    lo, hi = x.amin(-1), x.amax(-1)
    scale = torch.clamp_min((hi - lo) / 15.0, _MIN_SCALE)
    zero = _round_half_away(-lo / scale).clamp(0.0, 15.0)
    q = _round_half_away(x * (1.0 / scale)[..., None] + zero[..., None]).clamp(0.0, 15.0).to(torch.uint8)
    codes = q[..., 0::2] | (q[..., 1::2] << 4)
    bits = (scale.view(torch.int32) & -16) | (zero.to(torch.int32) & 0xF)
    return codes, bits.view(torch.float32)


def dequantize(codes: Tensor, scales: Tensor, fmt: PTHFormat) -> Tensor:
    """float32 rows ``[N, Hkv, D]`` of codes ``[N, Hkv, C]`` and scales ``[N, Hkv]`` (int4: in the
    rotated space, as stored)."""
    if not fmt.packed:
        return codes.float() * scales[..., None]
    values = torch.stack((codes & 0xF, codes >> 4), dim=-1).flatten(-2).float()
    bits = scales.view(torch.int32)
    zero = (bits & 0xF).float()
    scale = (bits & -16).view(torch.float32)
    return (values - zero[..., None]) * scale[..., None]


def records(key: Tensor, value: Tensor, fmt: PTHFormat) -> Tensor:
    """The uint8 slot records ``[T, Hkv * record]`` of K/V rows ``[T, Hkv, D]``."""
    parts = []
    for codes, scales in (quantize(key, fmt), quantize(value, fmt)):
        parts += [codes.view(torch.uint8), scales.contiguous().view(torch.uint8).view(*scales.shape, 4)]
    return torch.cat(parts, dim=-1).flatten(1)


def write(key: Tensor, value: Tensor, cache: PTHCache, slot_mapping: Tensor) -> None:
    """Quantise rows ``t`` of key/value into slot ``slot_mapping[t]`` (negative: padding, skipped).

    On CUDA, vLLM's own Triton writer runs on the slot views (one slot per block), so the bytes
    are vLLM's by construction; elsewhere the torch twin above writes whole slot records."""
    num_rows = slot_mapping.shape[0]
    if num_rows == 0:
        return
    key, value = key[:num_rows], value[:num_rows]
    if key.is_cuda:
        vllm_write(key, value, cache, slot_mapping)
        return
    slots = slot_mapping.long()
    keep = (slots >= 0).nonzero().squeeze(1)
    if keep.numel() < num_rows:
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel():
        cache.rows.index_copy_(0, slots, records(key, value, cache.fmt))


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


def gather(cache: PTHCache, slots: Tensor) -> tuple[Tensor, Tensor]:
    """Dequantised K and V ``[N, Hkv, D]`` (float32) of ``slots``: one gather of whole records."""
    rows = cache.rows.index_select(0, slots).view(slots.shape[0], cache.num_kv_heads, -1)
    codes = cache.fmt.code_bytes(cache.head_size)
    half = codes + _SCALE_BYTES

    def part(offset: int, size: int) -> Tensor:
        return rows[..., offset:offset + size]

    def scale(offset: int) -> Tensor:
        return part(offset, _SCALE_BYTES).contiguous().view(torch.float32).squeeze(-1)

    dtype = cache.fmt.code_dtype
    k = dequantize(part(0, codes).view(dtype), scale(codes), cache.fmt)
    v = dequantize(part(half, codes).view(dtype), scale(half + codes), cache.fmt)
    return k, v
