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
        from proxima.engine.attention.pth_cuda_write import vllm_write

        vllm_write(key, value, cache, slot_mapping)
        return
    slots = slot_mapping.long()
    keep = (slots >= 0).nonzero().squeeze(1)
    if keep.numel() < num_rows:
        slots, key, value = slots[keep], key[keep], value[keep]
    if slots.numel():
        cache.rows.index_copy_(0, slots, records(key, value, cache.fmt))


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
