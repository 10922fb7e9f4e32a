"""Pure-torch attention that reads K/V through a per-token slot table.

Layer: the math between the physical KV tensors (``[num_slots, Hkv, D]`` per layer, one slot
per token) and the model. Request -> token-position -> slot lives in ``slot_table``; nothing
here allocates or frees slots.

This module is both the CPU production path and the reference the Triton kernels in
``triton_attention.py`` are tested against, so it is batched torch, never a loop per token:

- decode requests (query length 1) are attended together: their K/V is gathered through the
  slot table into a padded ``[R, Hkv, max_len, D]`` tensor and attended under a length mask by
  one ``scaled_dot_product_attention`` call (GQA inside the kernel, no repeated K/V);
- prefill and chunked-prefill requests go one request at a time through
  ``scaled_dot_product_attention`` with a causal mask offset by the context already cached.

Speed on CPU comes from three choices, each measured (scripts/bench_cpu_attention.py): when K and
V are the two halves of one row per slot (the backend's layout, see ``slot_rows.kv_rows``) one
``index_select`` of whole rows gathers both; attention inputs are 4-D so the fused CPU kernel
runs instead of the math fallback; and the metadata is planned in numpy, not torch, because
this runs per layer per step on a handful of integers.

Invariants of the contract (shared with the Triton launcher; ``checks.py`` enforces its
shapes and dtypes):

- request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; those ``q_len``
  queries are its last ``q_len`` positions, so query ``i`` sits at absolute position
  ``seq_lens[r] - q_len + i`` and sees positions ``0..that`` (the new tokens' K/V are written
  with ``write_kv`` before attention runs);
- ``slot_table[r, p]`` is read only for ``p < seq_lens[r]``: entries beyond are garbage;
- output rows at or past ``min(num_actual_tokens, query_start_loc[-1])`` are never written;
- math is float32 inside whatever the storage dtype; output is written in the query dtype;
- an fp8 cache (``quant.py``) comes with its layer's ``KVScales``: ``write_kv`` quantises the
  rows it writes, attention reads ``float(stored) * scale`` with the scales folded into the
  (small) queries and outputs rather than into every gathered K/V element;
- a per-token-head cache (``per_token_head.py``) comes as its ``PTHCache`` views in
  ``kv_scales``, with ``k_cache``/``v_cache`` its code views: each gather reads whole slot
  records and dequantises them; int4 attends in vLLM's rotated space (queries rotated, the
  scale divided by D, the output rotated back).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from proxima.engine.attention import per_token_head
from proxima.engine.attention.checks import check_attention_args
from proxima.engine.attention.per_token_head import PTHCache
from proxima.engine.attention.quant import KVScales, head_scales
from proxima.engine.attention.slot_rows import gather_slots

# Upper bound on float32 elements of one gathered K (or V) block / score matrix. Decode batches
# and long prefills are cut into pieces under it, so a batch of long contexts cannot allocate
# gigabytes of padded copies at once.
_GATHER_BUDGET_ELEMENTS = 1 << 25
# Decode chunks aim lower still (2 MiB of float32 K, as much V): a chunk's K/V is gathered and
# read back at once by the kernel, and a block that stays in cache and under malloc's mmap
# threshold (pages reused, not faulted in afresh each call) is several times faster than one big
# pass on 8B-like shapes (scripts/bench_cpu_attention.py). Prefill pieces keep the larger bound:
# cutting them forces masked pieces where one causal call would do.
_DECODE_CHUNK_ELEMENTS = 1 << 19

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
    kv_scales: KVScales | PTHCache | None = None,
) -> Tensor:
    """Causal attention of each request's new queries over its slots; writes ``output`` in place.

    See the module docstring for the contract. Returns ``output``. ``max_query_len`` and
    ``max_seq_len`` are tiling hints for the Triton launcher, accepted here so the two share one
    signature; this path reads the metadata on the host and ignores them. ``kv_scales``: the
    layer's scales, given exactly when the cache is fp8 (or its views, when per token head).
    """
    del max_query_len, max_seq_len
    check_attention_args(query, k_cache, v_cache, slot_table, query_start_loc, seq_lens, output,
                         num_actual_tokens, kv_scales)
    if query_start_loc.shape[0] == 1:
        return output
    starts, ctx_lens, q_lens, row_limit, active = plan_rows(query_start_loc, seq_lens, num_actual_tokens,
                                                            query.shape[0], slot_table.shape[1])
    decode_reqs = np.flatnonzero(active & (q_lens == 1))
    prefill_reqs = np.flatnonzero(active & (q_lens > 1))
    pth = kv_scales if isinstance(kv_scales, PTHCache) else None
    fold = None if kv_scales is None or pth is not None else _fold_scales(kv_scales, query.shape[1],
                                                                            k_cache.shape[1])
    target = output
    if pth is not None and pth.fmt.packed:  # vLLM's int4: attention in the rotated space
        query = per_token_head.rotate(query)
        scale = scale / query.shape[-1]
        target = torch.empty(output.shape, dtype=torch.float32, device=output.device)

    if decode_reqs.size > 0:
        _attend_decodes(query, k_cache, v_cache, slot_table, starts[decode_reqs], decode_reqs,
                        ctx_lens[decode_reqs], scale, target, fold, pth)
    for req in prefill_reqs.tolist():
        start = int(starts[req])
        _attend_one_request(query, k_cache, v_cache, slot_table[req], start, int(q_lens[req]),
                            int(ctx_lens[req]), min(int(starts[req + 1]), row_limit) - start, scale, target,
                            fold, pth)
    if target is not output and row_limit > 0:
        output[:row_limit].copy_(per_token_head.unrotate(target[:row_limit]))
    return output


def _fold_scales(scales: KVScales, num_query_heads: int, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """K and V scales per query head as ``[Hq, 1, 1]``: q' = q * k_scale, out = attn(q', K, V) * v_scale.

    softmax(q . (k_scale * K)) V v_scale == softmax((q * k_scale) . K) V * v_scale, per KV head;
    scaling the queries and outputs touches Hq x D values per row instead of every gathered key.
    """
    group = num_query_heads // num_kv_heads

    def per_query_head(scale: Tensor) -> Tensor:
        return head_scales(scale, num_kv_heads).repeat_interleave(group, 0).unsqueeze(2)

    return per_query_head(scales.k), per_query_head(scales.v)


def plan_rows(query_start_loc: Tensor, seq_lens: Tensor, num_actual_tokens: int | None, num_rows: int,
              table_width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """A step's metadata on the host, checked: ``(starts, ctx_lens, q_lens, row_limit, active)``,
    ``active`` the requests with queries below the row limit (a boolean mask). Metadata is tiny:
    planning it in numpy costs microseconds per op where torch costs several, and this runs once
    per layer per step."""
    starts = query_start_loc.cpu().numpy().astype(np.int64)
    ctx_lens = seq_lens[: starts.shape[0] - 1].cpu().numpy().astype(np.int64)
    q_lens = starts[1:] - starts[:-1]
    _check_metadata_values(starts, q_lens, ctx_lens, num_rows, table_width)
    row_limit = int(starts[-1])
    if num_actual_tokens is not None:
        row_limit = min(row_limit, num_actual_tokens)
    return starts, ctx_lens, q_lens, row_limit, (q_lens > 0) & (starts[:-1] < row_limit)


def _gather_float(k_cache: Tensor, v_cache: Tensor, slots: Tensor,
                  pth: PTHCache | None = None) -> tuple[Tensor, Tensor]:
    """K and V of ``slots`` (1-D, all valid) as ``[N, Hkv, D]`` float32 tensors (views allowed)."""
    if pth is not None:
        return per_token_head.gather(pth, slots)
    return gather_slots(k_cache, v_cache, slots, torch.float32)


def _check_metadata_values(
    starts: np.ndarray, q_lens: np.ndarray, ctx_lens: np.ndarray, num_rows: int, table_width: int
) -> None:
    if starts[0] < 0:
        raise ValueError(f"slot attention: query_start_loc[0]={int(starts[0])} is negative")
    if (q_lens < 0).any():
        raise ValueError("slot attention: query_start_loc is not non-decreasing")
    if starts[-1] > num_rows:
        raise ValueError(
            f"slot attention: query_start_loc[-1]={int(starts[-1])} exceeds the {num_rows} query rows"
        )
    live = q_lens > 0
    if (ctx_lens[live] < q_lens[live]).any():
        raise ValueError(
            "slot attention: a request has seq_lens < its query length (new tokens must be in the cache)"
        )
    if (ctx_lens[live] > table_width).any():
        raise ValueError(f"slot attention: a request's seq_len exceeds slot_table width {table_width}")


def _run_start(indices: np.ndarray) -> int | None:
    """First index when strictly increasing ``indices`` are one run (a slice will do), else None."""
    first = int(indices[0])
    return first if int(indices[-1]) - first == indices.shape[0] - 1 else None


def _select(tensor: Tensor, indices: np.ndarray) -> Tensor:
    """Rows ``indices`` (strictly increasing) of ``tensor``: a view when they are one run."""
    first = _run_start(indices)
    if first is not None:
        return tensor[first:first + indices.shape[0]]
    return tensor.index_select(0, torch.from_numpy(indices).to(tensor.device))


def _write_rows(output: Tensor, indices: np.ndarray, values: Tensor) -> None:
    """``output[indices] = values`` (cast to the output dtype), a slice copy when one run."""
    first = _run_start(indices)
    if first is not None:
        output[first:first + indices.shape[0]].copy_(values)
    else:
        output.index_copy_(0, torch.from_numpy(indices).to(output.device), values.to(output.dtype))


def _attend_decodes(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    token_rows: np.ndarray,
    req_ids: np.ndarray,
    ctx_lens: np.ndarray,
    scale: float,
    output: Tensor,
    fold: tuple[Tensor, Tensor] | None = None,
    pth: PTHCache | None = None,
) -> None:
    """All single-query requests at once, in chunks under the gather budget.

    Each chunk is padded to its longest context: K/V ``[n, Hkv, L, D]`` under a length mask,
    one ``scaled_dot_product_attention`` call with the query as ``[n, Hq, 1, D]``.
    """
    per_request_token = k_cache.shape[1] * query.shape[2]  # elements of one K (or V) per position
    budget = min(_GATHER_BUDGET_ELEMENTS, _DECODE_CHUNK_ELEMENTS)

    def chunk_size(max_len: int) -> int:
        return max(1, budget // max(max_len * per_request_token, 1))

    num_decodes = ctx_lens.shape[0]
    if chunk_size(int(ctx_lens.max())) >= num_decodes:  # the common case: one chunk, no sort
        _attend_decode_chunk(query, k_cache, v_cache, slot_table, token_rows, req_ids, ctx_lens,
                             scale, output, fold, pth)
        return
    # Longest first, so each chunk pads only to its own longest context.
    order = np.argsort(-ctx_lens, kind="stable")
    begin = 0
    while begin < num_decodes:
        end = min(num_decodes, begin + chunk_size(int(ctx_lens[order[begin]])))
        picked = np.sort(order[begin:end])  # back to increasing rows, as _select expects
        _attend_decode_chunk(query, k_cache, v_cache, slot_table, token_rows[picked], req_ids[picked],
                             ctx_lens[picked], scale, output, fold, pth)
        begin = end


def _attend_decode_chunk(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    token_rows: np.ndarray,
    req_ids: np.ndarray,
    ctx_lens: np.ndarray,
    scale: float,
    output: Tensor,
    fold: tuple[Tensor, Tensor] | None = None,
    pth: PTHCache | None = None,
) -> None:
    """Decodes whose rows and requests are strictly increasing, padded to their longest context."""
    device = query.device
    num_kv_heads, head_size = k_cache.shape[1], query.shape[2]
    num_query_heads = query.shape[1]
    num, max_len = ctx_lens.shape[0], int(ctx_lens.max())
    slots = _select(slot_table, req_ids)[:, :max_len]
    mask = None
    if int(ctx_lens.min()) < max_len:
        lens = torch.from_numpy(ctx_lens).to(device)
        visible = torch.arange(max_len, device=device)[None, :] < lens[:, None]  # [n, L]
        # Entries past a request's length are garbage: point them at slot 0 rather than read them.
        slots = torch.where(visible, slots, 0)
        mask = visible[:, None, None, :]  # [n, 1, 1, L]: every head, the one query
    keys, values = _gather_float(k_cache, v_cache, slots.reshape(-1), pth)
    keys = keys.view(num, max_len, num_kv_heads, head_size).transpose(1, 2)  # [n, Hkv, L, D]
    values = values.view(num, max_len, num_kv_heads, head_size).transpose(1, 2)
    q = _select(query, token_rows).float().unsqueeze(2)  # [n, Hq, 1, D]
    if fold is not None:
        q = q * fold[0]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=num_query_heads != num_kv_heads)
    if fold is not None:
        out = out * fold[1]
    _write_rows(output, token_rows, out.squeeze(2))


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
    fold: tuple[Tensor, Tensor] | None = None,
    pth: PTHCache | None = None,
) -> None:
    """One prefill / chunked-prefill request; queries cut into pieces under the gather budget."""
    device = query.device
    num_query_heads, num_kv_heads = query.shape[1], k_cache.shape[1]
    context = seq_len - q_len  # tokens cached before this step's queries
    keys, values = _gather_float(k_cache, v_cache, slot_row[:seq_len], pth)
    # 4-D [1, H, L, D]: the fused (flash) CPU kernel takes only 4-D inputs; 3-D falls back to
    # the math kernel, which materializes the score matrix.
    keys, values = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    piece = max(1, _GATHER_BUDGET_ELEMENTS // (num_query_heads * seq_len))
    for first in range(0, rows_to_write, piece):
        last = min(rows_to_write, first + piece)
        q = query[start + first:start + last].float().transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if fold is not None:
            q = q * fold[0]
        num_keys = context + last  # later keys are masked for every query of this piece
        offset = context + first  # absolute position of the piece's first query
        if offset == 0:  # square block from position 0: plain causal, no mask to build or read
            causal, mask = True, None
        else:
            # Additive mask, -inf where key j > query i's position (j - i > offset): one op, and
            # the kernel reads a float mask as is where a boolean one is converted first.
            causal = False
            mask = torch.full((last - first, num_keys), float("-inf"), device=device).triu_(offset + 1)
        out = F.scaled_dot_product_attention(
            q, keys[:, :, :num_keys], values[:, :, :num_keys], attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=num_query_heads != num_kv_heads,
        )
        if fold is not None:
            out = out * fold[1]
        output[start + first:start + last].copy_(out[0].transpose(0, 1))
