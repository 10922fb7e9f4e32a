"""K and V rows of a slot cache: the layout, the gather and the write (the torch side).

Layer: storage only, no attention math. One slot holds one token's K and V for every KV head,
``[num_slots, Hkv, D]`` each; the backend lays K and V as the two halves of one row per slot, so
a gather or a write of whole rows moves both in one pass (``kv_rows``). ``reference`` attends
over what ``gather_slots`` returns, ``vllm_cpu_kernel`` hands it to vLLM's CPU kernel, and the
backend writes each step's new tokens with ``write_kv`` (``triton_write_kv`` is its GPU twin).
"""

from __future__ import annotations

import torch
from torch import Tensor

from proxima.engine.attention.checks import check_write_kv_args
from proxima.engine.attention.quant import KVScales, Rounding, is_fp8, quantize_fp8


def kv_rows(k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, int] | None:
    """``[num_slots, 2*Hkv*D]`` view when K and V of each slot exactly tile one row, else None.

    The backend's cache is such a layout (``rows[..., :D]`` / ``rows[..., D:]`` of one
    ``[num_slots, Hkv, 2*D]`` buffer) and so is ``[num_slots, 2, Hkv, D]``. One ``index_select``
    of whole rows then gathers K and V together, a copy of contiguous runs, where indexing the
    strided halves separately walks them element by element (tens of times slower on CPU).
    Exact tiling matters to ``write_kv``, which writes whole rows. Returns the rows and the
    element offset of V inside a row (K starts the row).
    """
    num_slots, num_heads, head_size = k_cache.shape
    row = 2 * num_heads * head_size
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        return None
    if k_cache.untyped_storage().data_ptr() != v_cache.untyped_storage().data_ptr():
        return None
    stride_slot, stride_head, stride_dim = k_cache.stride()
    if (num_slots > 1 and stride_slot != row) or (head_size > 1 and stride_dim != 1):
        return None
    v_offset = v_cache.storage_offset() - k_cache.storage_offset()
    if num_heads == 1:
        tiles = v_offset == head_size
    else:  # per head K|V (the backend's), or all heads' K | all heads' V
        tiles = (stride_head, v_offset) in ((2 * head_size, head_size), (head_size, num_heads * head_size))
    return (k_cache.as_strided((num_slots, row), (row, 1)), v_offset) if tiles else None


def _split_rows(rows: Tensor, v_offset: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """K and V views ``[N, Hkv, D]`` of gathered rows ``[N, row]`` (laid out as in ``like``)."""
    shape = (rows.shape[0], *like.shape[1:])
    stride = (rows.stride(0), *like.stride()[1:])
    base = rows.storage_offset()
    return rows.as_strided(shape, stride, base), rows.as_strided(shape, stride, base + v_offset)


def gather_slots(k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                 dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """K and V of ``slots`` (1-D, all valid) as ``[N, Hkv, D]`` tensors (views allowed), in
    ``dtype`` (None: the cache's own). When K and V tile one row (``kv_rows``), one gather of
    whole rows, converted in one pass."""
    packed = kv_rows(k_cache, v_cache)
    if packed is None:
        keys, values = k_cache.index_select(0, slots), v_cache.index_select(0, slots)
        return (keys, values) if dtype is None else (keys.to(dtype), values.to(dtype))
    rows, v_offset = packed
    gathered = rows.index_select(0, slots)
    return _split_rows(gathered if dtype is None else gathered.to(dtype), v_offset, k_cache)


def _codes(t: Tensor) -> Tensor:
    """fp8 tensors as their uint8 codes (torch's CPU index_copy_ has no fp8 kernel); others as is."""
    return t.view(torch.uint8) if is_fp8(t.dtype) else t


def write_kv(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
    scales: KVScales | None = None, rounding: Rounding = "nearest",
) -> None:
    """Copy row ``t`` of key/value into slot ``slot_mapping[t]``; negative slots are padding.

    ``key``/``value`` may carry padding rows past ``len(slot_mapping)``; those are ignored.
    Slots must be distinct (a duplicate would make the surviving row unspecified). An fp8 cache
    takes model-dtype rows and its ``scales``; each written row is quantised once, with
    ``rounding`` (vLLM's CPU writer rounds toward zero, its CUDA writers to nearest: quant.py).
    """
    check_write_kv_args(key, value, k_cache, v_cache, slot_mapping, scales)
    num_rows = slot_mapping.shape[0]
    if num_rows == 0:
        return
    slots, key, value = slot_mapping.long(), key[:num_rows], value[:num_rows]
    # One pass gives both the range check and whether there is padding to drop; the common
    # step has none and skips the mask. (Reading them back syncs a GPU; this is the CPU path:
    # the Triton writer skips padding in-kernel instead, so it stays graph-capturable.)
    lowest, highest = (int(x) for x in torch.aminmax(slots))
    if highest >= k_cache.shape[0]:
        raise ValueError(f"write_kv: slot {highest} out of range for a cache of {k_cache.shape[0]} slots")
    if lowest < 0:
        rows = (slots >= 0).nonzero().squeeze(1)
        if rows.numel() == 0:
            return
        slots, key, value = slots[rows], key[rows], value[rows]
    if scales is not None:
        key = quantize_fp8(key, scales.k, k_cache.dtype, rounding)
        value = quantize_fp8(value, scales.v, v_cache.dtype, rounding)
    packed = kv_rows(k_cache, v_cache)
    if packed is None:
        _codes(k_cache).index_copy_(0, slots, _codes(key))
        _codes(v_cache).index_copy_(0, slots, _codes(value))
        return
    # Assemble whole rows, then scatter them in one pass over contiguous destinations.
    cache_rows, v_offset = packed
    source = torch.empty((slots.shape[0], cache_rows.shape[1]), dtype=key.dtype, device=key.device)
    source_keys, source_values = _split_rows(source, v_offset, k_cache)
    source_keys.copy_(key)
    source_values.copy_(value)
    _codes(cache_rows).index_copy_(0, slots, _codes(source))
