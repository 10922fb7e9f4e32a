"""Shape and dtype contract of slot attention and of the K/V write, checked on the host.

Layer: called by both implementations (``reference`` and ``triton_attention``) before any work,
once per layer per step. No value is read from device memory (that would sync a GPU); each
check builds its error message only when it fails, because this runs on the hot path.
A failed check raises ValueError naming the argument and what was expected.

fp8 caches (``quant.py``): a cache of an fp8 dtype comes with its layer's ``KVScales`` and a
cache of the model dtype without; either mismatch raises, since it would mean reading raw fp8
codes as values, or quantising twice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from proxima.engine.attention.per_token_head import PTHCache
from proxima.engine.attention.quant import KVScales, is_fp8

_INDEX_DTYPES = (torch.int32, torch.int64)
_VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _one_device(who: str, tensors: tuple[Tensor, ...]) -> None:
    device = tensors[0].device
    if any(t.device != device for t in tensors[1:]):
        raise ValueError(
            f"{who}: all tensors must be on one device, got {sorted({str(t.device) for t in tensors})}"
        )


def check_unit_stride(who: str, named: tuple[tuple[str, Tensor], ...]) -> None:
    """The Triton kernels read each head's D values as one contiguous run."""
    for name, t in named:
        if t.stride(-1) != 1:
            raise ValueError(f"{who}: {name} must have unit stride along D, got strides {t.stride()}")


def check_kv_scales(who: str, k_cache: Tensor, v_cache: Tensor, scales: KVScales | PTHCache | None) -> None:
    """An fp8 cache has scales of 1 or Hkv float32 elements on its device; a per-token-head cache
    comes as its views (codes and a scale per slot and head); any other cache has none."""
    if isinstance(scales, PTHCache):
        if k_cache.dtype != scales.fmt.code_dtype or v_cache.dtype != scales.fmt.code_dtype:
            raise ValueError(f"{who}: {scales.fmt.name} codes must be {scales.fmt.code_dtype}, got "
                             f"{k_cache.dtype} and {v_cache.dtype}")
        if scales.k_scales.shape != k_cache.shape[:2] or scales.k_scales.dtype != torch.float32:
            raise ValueError(f"{who}: {scales.fmt.name} scales must be float32 [slots, Hkv]")
        return
    fp8 = is_fp8(k_cache.dtype)
    if fp8 != (scales is not None):
        raise ValueError(
            f"{who}: cache dtype {k_cache.dtype} "
            + ("needs the layer's k/v scales" if fp8 else "is not fp8 but scales were given")
        )
    if scales is None:
        return
    num_kv_heads = k_cache.shape[1]
    for name, scale in (("k_scale", scales.k), ("v_scale", scales.v)):
        if scale.numel() not in (1, num_kv_heads) or scale.dtype != torch.float32:
            raise ValueError(
                f"{who}: {name} must be float32 with 1 or Hkv={num_kv_heads} elements, got "
                f"{scale.dtype} shape {tuple(scale.shape)}"
            )
        if scale.device != k_cache.device:
            raise ValueError(f"{who}: {name} is on {scale.device}, the cache on {k_cache.device}")


def check_write_kv_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    scales: KVScales | None = None,
) -> None:
    """Shape/dtype contract of ``write_kv``; raises ValueError naming the offending argument."""
    if key.dim() != 3:
        raise ValueError(f"write_kv: key must be [T, Hkv, D], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"write_kv: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    if k_cache.dim() != 3:
        raise ValueError(f"write_kv: k_cache must be [num_slots, Hkv, D], got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"write_kv: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    if key.shape[1:] != k_cache.shape[1:]:
        raise ValueError(
            f"write_kv: key rows {tuple(key.shape[1:])} do not match cache rows {tuple(k_cache.shape[1:])}"
        )
    check_kv_scales("write_kv", k_cache, v_cache, scales)
    stored = key.dtype if scales is None else k_cache.dtype  # fp8 caches take model-dtype rows
    if not (key.dtype == value.dtype and k_cache.dtype == v_cache.dtype == stored):
        raise ValueError(
            f"write_kv: key/value/k_cache/v_cache dtypes differ "
            f"({key.dtype}, {value.dtype}, {k_cache.dtype}, {v_cache.dtype}); cast before writing"
        )
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"write_kv: slot_mapping must be 1-D int32/int64, got {slot_mapping.dtype} "
            f"shape {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.shape[0] > key.shape[0]:
        raise ValueError(
            f"write_kv: slot_mapping has {slot_mapping.shape[0]} entries but key only {key.shape[0]} rows"
        )
    _one_device("write_kv", (key, value, k_cache, v_cache, slot_mapping))


def check_attention_args(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    output: Tensor,
    num_actual_tokens: int | None,
    scales: KVScales | PTHCache | None = None,
) -> None:
    """Shape/dtype contract of slot attention (no value checks: those would sync a GPU)."""
    if query.dim() != 3:
        raise ValueError(f"slot attention: query must be [T, Hq, D], got shape {tuple(query.shape)}")
    if query.dtype not in _VALUE_DTYPES:
        raise ValueError(f"slot attention: query dtype {query.dtype} not in {_VALUE_DTYPES}")
    if output.shape != query.shape:
        raise ValueError(
            f"slot attention: output shape {tuple(output.shape)} != query shape {tuple(query.shape)}"
        )
    if output.dtype != query.dtype:
        raise ValueError(f"slot attention: output dtype {output.dtype} != query dtype {query.dtype}")
    if k_cache.dim() != 3:
        raise ValueError(
            f"slot attention: k_cache must be [num_slots, Hkv, D], got shape {tuple(k_cache.shape)}"
        )
    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"slot attention: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}"
        )
    check_kv_scales("slot attention", k_cache, v_cache, scales)
    stored = query.dtype if scales is None else k_cache.dtype
    pth = scales if isinstance(scales, PTHCache) else None
    if not k_cache.dtype == v_cache.dtype == stored:
        raise ValueError(
            f"slot attention: k_cache/v_cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal "
            f"query dtype {query.dtype}"
        )
    num_query_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape[2] != (head_size if pth is None else pth.fmt.code_bytes(head_size)):
        raise ValueError(
            f"slot attention: cache rows of {k_cache.shape[2]} elements do not hold query head size "
            f"{head_size}" + (f" as {pth.fmt.name}" if pth is not None else "")
        )
    if num_kv_heads == 0 or num_query_heads % num_kv_heads:
        raise ValueError(f"slot attention: Hq={num_query_heads} is not a multiple of Hkv={num_kv_heads}")
    if slot_table.dim() != 2 or slot_table.dtype not in _INDEX_DTYPES:
        raise ValueError(
            f"slot attention: slot_table must be 2-D int32/int64, got {slot_table.dtype} "
            f"shape {tuple(slot_table.shape)}"
        )
    if (query_start_loc.dim() != 1 or query_start_loc.shape[0] < 1
            or query_start_loc.dtype not in _INDEX_DTYPES):
        raise ValueError(
            f"slot attention: query_start_loc must be 1-D int32/int64 of R+1 >= 1 entries, got "
            f"{query_start_loc.dtype} shape {tuple(query_start_loc.shape)}"
        )
    num_requests = query_start_loc.shape[0] - 1
    if seq_lens.dim() != 1 or seq_lens.dtype not in _INDEX_DTYPES or seq_lens.shape[0] < num_requests:
        raise ValueError(
            f"slot attention: seq_lens must be 1-D int32/int64 with >= R={num_requests} entries, got "
            f"{seq_lens.dtype} shape {tuple(seq_lens.shape)}"
        )
    if slot_table.shape[0] < num_requests:
        raise ValueError(
            f"slot attention: slot_table has {slot_table.shape[0]} rows, fewer than R={num_requests}"
        )
    if num_actual_tokens is not None and not (
        isinstance(num_actual_tokens, int) and 0 <= num_actual_tokens <= query.shape[0]
    ):
        raise ValueError(
            f"slot attention: num_actual_tokens={num_actual_tokens!r} must be an int in [0, {query.shape[0]}]"
        )
    _one_device("slot attention", (query, k_cache, v_cache, slot_table, query_start_loc, seq_lens, output))
