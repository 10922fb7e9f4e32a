"""Pure-torch attention that reads K/V through a per-token slot table.

Layer: the math between the physical KV tensors (``[num_slots, Hkv, D]`` per layer, one slot
per token) and the model. Request -> token-position -> slot lives in ``slot_table``; nothing
here allocates or frees slots.

This module is both the CPU production path and the reference the Triton kernels in
``triton_attention.py`` are tested against, so it is batched torch, never a loop per token:

- decode requests (query length 1) are attended together: their K/V is gathered through the
  slot table into a padded ``[R, max_len, Hkv, D]`` tensor and softmaxed under a length mask;
- prefill and chunked-prefill requests go one request at a time through
  ``scaled_dot_product_attention`` with a causal mask offset by the context already cached.

Invariants of the contract (shared with the Triton launcher):

- request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; those ``q_len``
  queries are its last ``q_len`` positions, so query ``i`` sits at absolute position
  ``seq_lens[r] - q_len + i`` and sees positions ``0..that`` (the new tokens' K/V are written
  with ``write_kv`` before attention runs);
- ``slot_table[r, p]`` is read only for ``p < seq_lens[r]``: entries beyond are garbage;
- output rows at or past ``min(num_actual_tokens, query_start_loc[-1])`` are never written;
- math is float32 inside whatever the storage dtype; output is written in the query dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Upper bound on float32 elements of one gathered K (or V) block / score matrix. Decode batches
# and long prefills are cut into pieces under it, so a batch of long contexts cannot allocate
# gigabytes of padded copies at once.
_GATHER_BUDGET_ELEMENTS = 1 << 25

_INDEX_DTYPES = (torch.int32, torch.int64)
_VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_write_kv_args(
    key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor
) -> None:
    """Shape/dtype contract of ``write_kv``; raises ValueError naming the offending argument."""
    _require(key.dim() == 3, f"write_kv: key must be [T, Hkv, D], got shape {tuple(key.shape)}")
    _require(value.shape == key.shape,
             f"write_kv: value shape {tuple(value.shape)} != key shape {tuple(key.shape)}")
    _require(k_cache.dim() == 3,
             f"write_kv: k_cache must be [num_slots, Hkv, D], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape,
             f"write_kv: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    _require(key.shape[1:] == k_cache.shape[1:],
             f"write_kv: key rows {tuple(key.shape[1:])} do not match cache rows {tuple(k_cache.shape[1:])}")
    _require(key.dtype == value.dtype == k_cache.dtype == v_cache.dtype,
             f"write_kv: key/value/k_cache/v_cache dtypes differ "
             f"({key.dtype}, {value.dtype}, {k_cache.dtype}, {v_cache.dtype}); cast before writing")
    _require(slot_mapping.dim() == 1 and slot_mapping.dtype in _INDEX_DTYPES,
             f"write_kv: slot_mapping must be 1-D int32/int64, got {slot_mapping.dtype} "
             f"shape {tuple(slot_mapping.shape)}")
    _require(slot_mapping.shape[0] <= key.shape[0],
             f"write_kv: slot_mapping has {slot_mapping.shape[0]} entries but key only {key.shape[0]} rows")
    devices = {t.device for t in (key, value, k_cache, v_cache, slot_mapping)}
    _require(len(devices) == 1,
             f"write_kv: all tensors must be on one device, got {sorted(map(str, devices))}")


def check_attention_args(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    output: Tensor,
    num_actual_tokens: int | None,
) -> None:
    """Shape/dtype contract of slot attention (no value checks: those would sync a GPU)."""
    _require(query.dim() == 3, f"slot attention: query must be [T, Hq, D], got shape {tuple(query.shape)}")
    _require(query.dtype in _VALUE_DTYPES,
             f"slot attention: query dtype {query.dtype} not in {_VALUE_DTYPES}")
    _require(output.shape == query.shape,
             f"slot attention: output shape {tuple(output.shape)} != query shape {tuple(query.shape)}")
    _require(output.dtype == query.dtype,
             f"slot attention: output dtype {output.dtype} != query dtype {query.dtype}")
    _require(k_cache.dim() == 3,
             f"slot attention: k_cache must be [num_slots, Hkv, D], got shape {tuple(k_cache.shape)}")
    _require(v_cache.shape == k_cache.shape,
             f"slot attention: v_cache shape {tuple(v_cache.shape)} != k_cache shape {tuple(k_cache.shape)}")
    _require(k_cache.dtype == v_cache.dtype == query.dtype,
             f"slot attention: k_cache/v_cache dtypes ({k_cache.dtype}, {v_cache.dtype}) must equal "
             f"query dtype {query.dtype}")
    num_query_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[1]
    _require(k_cache.shape[2] == head_size,
             f"slot attention: cache head size {k_cache.shape[2]} != query head size {head_size}")
    _require(num_kv_heads > 0 and num_query_heads % num_kv_heads == 0,
             f"slot attention: Hq={num_query_heads} is not a multiple of Hkv={num_kv_heads}")
    _require(slot_table.dim() == 2 and slot_table.dtype in _INDEX_DTYPES,
             f"slot attention: slot_table must be 2-D int32/int64, got {slot_table.dtype} "
             f"shape {tuple(slot_table.shape)}")
    _require(query_start_loc.dim() == 1 and query_start_loc.shape[0] >= 1
             and query_start_loc.dtype in _INDEX_DTYPES,
             f"slot attention: query_start_loc must be 1-D int32/int64 of R+1 >= 1 entries, got "
             f"{query_start_loc.dtype} shape {tuple(query_start_loc.shape)}")
    num_requests = query_start_loc.shape[0] - 1
    _require(seq_lens.dim() == 1 and seq_lens.dtype in _INDEX_DTYPES and seq_lens.shape[0] >= num_requests,
             f"slot attention: seq_lens must be 1-D int32/int64 with >= R={num_requests} entries, got "
             f"{seq_lens.dtype} shape {tuple(seq_lens.shape)}")
    _require(slot_table.shape[0] >= num_requests,
             f"slot attention: slot_table has {slot_table.shape[0]} rows, fewer than R={num_requests}")
    if num_actual_tokens is not None:
        _require(isinstance(num_actual_tokens, int) and 0 <= num_actual_tokens <= query.shape[0],
                 f"slot attention: num_actual_tokens={num_actual_tokens!r} must be an int in "
                 f"[0, {query.shape[0]}]")
    tensors = (query, k_cache, v_cache, slot_table, query_start_loc, seq_lens, output)
    devices = {t.device for t in tensors}
    _require(len(devices) == 1,
             f"slot attention: all tensors must be on one device, got {sorted(map(str, devices))}")


def write_kv(key: Tensor, value: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Copy row ``t`` of key/value into slot ``slot_mapping[t]``; negative slots are padding.

    ``key``/``value`` may carry padding rows past ``len(slot_mapping)``; those are ignored.
    Slots must be distinct (a duplicate would make the surviving row unspecified).
    """
    check_write_kv_args(key, value, k_cache, v_cache, slot_mapping)
    num_rows = slot_mapping.shape[0]
    if num_rows == 0:
        return
    slots = slot_mapping.long()
    keep = slots >= 0
    # Dropping padding rows costs a host sync; that is fine on the CPU path this serves. The
    # Triton writer skips them in-kernel instead, so it stays graph-capturable.
    rows = keep.nonzero().squeeze(1)
    if rows.numel() == 0:
        return
    slots = slots[rows]
    max_slot = int(slots.max())
    _require(max_slot < k_cache.shape[0],
             f"write_kv: slot {max_slot} out of range for a cache of {k_cache.shape[0]} slots")
    k_cache.index_copy_(0, slots, key[:num_rows][rows])
    v_cache.index_copy_(0, slots, value[:num_rows][rows])


def slot_attention_torch(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    output: Tensor,
    num_actual_tokens: int | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> Tensor:
    """Causal attention of each request's new queries over its slots; writes ``output`` in place.

    See the module docstring for the contract. Returns ``output``. ``max_query_len`` and
    ``max_seq_len`` are tiling hints for the Triton launcher, accepted here so the two share one
    signature; this path reads the metadata on the host and ignores them.
    """
    del max_query_len, max_seq_len
    check_attention_args(query, k_cache, v_cache, slot_table, query_start_loc, seq_lens, output,
                         num_actual_tokens)
    num_requests = query_start_loc.shape[0] - 1
    if num_requests == 0:
        return output
    # Metadata is tiny; one host copy lets us validate values and plan the batch.
    starts = query_start_loc.to("cpu", torch.int64)
    ctx_lens = seq_lens[:num_requests].to("cpu", torch.int64)
    q_lens = starts[1:] - starts[:-1]
    _check_metadata_values(starts, q_lens, ctx_lens, query.shape[0], slot_table.shape[1])

    row_limit = int(starts[-1])
    if num_actual_tokens is not None:
        row_limit = min(row_limit, num_actual_tokens)
    active = (q_lens > 0) & (starts[:-1] < row_limit)
    decode_reqs = (active & (q_lens == 1)).nonzero().squeeze(1)
    prefill_reqs = (active & (q_lens > 1)).nonzero().squeeze(1)

    if decode_reqs.numel() > 0:
        _attend_decodes(query, k_cache, v_cache, slot_table, starts[decode_reqs], decode_reqs,
                        ctx_lens[decode_reqs], scale, output)
    for req in prefill_reqs.tolist():
        start = int(starts[req])
        _attend_one_request(query, k_cache, v_cache, slot_table[req], start, int(q_lens[req]),
                            int(ctx_lens[req]), min(int(starts[req + 1]), row_limit) - start, scale, output)
    return output


def _check_metadata_values(
    starts: Tensor, q_lens: Tensor, ctx_lens: Tensor, num_rows: int, table_width: int
) -> None:
    _require(int(starts[0]) >= 0, f"slot attention: query_start_loc[0]={int(starts[0])} is negative")
    _require(bool((q_lens >= 0).all()), "slot attention: query_start_loc is not non-decreasing")
    _require(int(starts[-1]) <= num_rows,
             f"slot attention: query_start_loc[-1]={int(starts[-1])} exceeds the {num_rows} query rows")
    live = q_lens > 0
    _require(bool((ctx_lens[live] >= q_lens[live]).all()),
             "slot attention: a request has seq_lens < its query length (new tokens must be in the cache)")
    _require(bool((ctx_lens[live] <= table_width).all()),
             f"slot attention: a request's seq_len exceeds slot_table width {table_width}")


def _attend_decodes(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    token_rows: Tensor,
    req_ids: Tensor,
    ctx_lens: Tensor,
    scale: float,
    output: Tensor,
) -> None:
    """All single-query requests at once, in length-sorted chunks under the gather budget."""
    device = query.device
    num_kv_heads, head_size = k_cache.shape[1], k_cache.shape[2]
    num_query_heads = query.shape[1]
    group = num_query_heads // num_kv_heads
    # Longest first, so each chunk pads only to its own longest context.
    order = torch.argsort(ctx_lens, descending=True)
    token_rows, req_ids, ctx_lens = token_rows[order], req_ids[order], ctx_lens[order]
    num_decodes = ctx_lens.shape[0]
    begin = 0
    while begin < num_decodes:
        max_len = int(ctx_lens[begin])
        per_request = max_len * num_kv_heads * head_size
        end = min(num_decodes, begin + max(1, _GATHER_BUDGET_ELEMENTS // max(per_request, 1)))
        rows = token_rows[begin:end].to(device)
        lens = ctx_lens[begin:end].to(device)
        positions = torch.arange(max_len, device=device)
        visible = positions[None, :] < lens[:, None]  # [n, L]
        slots = slot_table[req_ids[begin:end].to(device), :max_len].long()
        # Entries past a request's length are garbage: point them at slot 0 rather than read them.
        slots = torch.where(visible, slots, torch.zeros_like(slots))
        keys = k_cache[slots].float()  # [n, L, Hkv, D]
        values = v_cache[slots].float()
        q = query[rows].float().view(-1, num_kv_heads, group, head_size)  # GQA: Hq as Hkv x group
        scores = torch.einsum("nhgd,nlhd->nhgl", q, keys) * scale
        scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("nhgl,nlhd->nhgd", probs, values)
        output[rows] = out.reshape(-1, num_query_heads, head_size).to(output.dtype)
        begin = end


def _attend_one_request(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_row: Tensor,
    start: int,
    q_len: int,
    seq_len: int,
    rows_to_write: int,
    scale: float,
    output: Tensor,
) -> None:
    """One prefill / chunked-prefill request; queries cut into pieces under the gather budget."""
    device = query.device
    num_query_heads, num_kv_heads = query.shape[1], k_cache.shape[1]
    context = seq_len - q_len  # tokens cached before this step's queries
    slots = slot_row[:seq_len].long()
    keys = k_cache[slots].float().transpose(0, 1)  # [Hkv, L, D]
    values = v_cache[slots].float().transpose(0, 1)
    piece = max(1, _GATHER_BUDGET_ELEMENTS // (num_query_heads * seq_len))
    for first in range(0, rows_to_write, piece):
        last = min(rows_to_write, first + piece)
        q = query[start + first:start + last].float().transpose(0, 1)  # [Hq, n, D]
        q_pos = context + torch.arange(first, last, device=device)
        num_keys = context + last  # later keys are masked for every query of this piece
        causal = torch.arange(num_keys, device=device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(
            q, keys[:, :num_keys], values[:, :num_keys], attn_mask=causal, scale=scale,
            enable_gqa=num_query_heads != num_kv_heads,
        )
        output[start + first:start + last] = out.transpose(0, 1).to(output.dtype)
