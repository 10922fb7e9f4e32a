"""The CPU path for an unquantised cache: vLLM's own CPU kernel over the gathered slots.

Held to stock vLLM's CPU attention itself: the same K/V, queries and positions in stock's block
cache (blocks in shuffled order, block size 128, the ISA stock picks) and in Proxima's slots
(shuffled), and the outputs bit for bit equal. Any slip in the gather, the scratch mapping, the
block table or the query rows shows as unequal bits.
"""

from __future__ import annotations

import math

import pytest
import torch

from proxima.engine.attention import vllm_cpu_kernel
from proxima.engine.attention.quant import KVScales
from proxima.engine.attention.reference import slot_attention_torch

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 9, 3, 64, 128  # SmolLM2-135M's attention; vLLM's CPU block


@pytest.fixture(scope="module")
def ops():
    if vllm_cpu_kernel.isa(torch.bfloat16, HEAD_SIZE) != "amx":
        pytest.skip("needs vLLM's CPU build on a CPU with AMX tiles")
    from vllm import _custom_ops

    return _custom_ops


def _case(requests: list[tuple[int, int]], dtype: torch.dtype, seed: int):
    """(q_len, seq_len) per request; queries scaled so that attention is peaked, as a trained
    model's is, rather than near uniform."""
    gen = torch.Generator().manual_seed(seed)
    keys = [torch.randn(s, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype) for _, s in requests]
    values = [torch.randn(s, KV_HEADS, HEAD_SIZE, generator=gen).to(dtype) for _, s in requests]
    query = (torch.randn(sum(q for q, _ in requests) + 3, HEADS, HEAD_SIZE, generator=gen) * 3).to(dtype)
    starts = torch.tensor([0] + [q for q, _ in requests]).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in requests], dtype=torch.int32)
    return keys, values, query, starts, seq_lens


def _stock(ops, keys, values, query, starts, seq_lens) -> torch.Tensor:
    """vLLM's CPU attention over its own block cache holding the K/V, as its backend runs it."""
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(query.dtype, BLOCK, HEAD_SIZE, "auto")
    live = [r for r, k in enumerate(keys) if int(starts[r + 1]) > int(starts[r])]
    blocks = [math.ceil(len(keys[r]) / BLOCK) for r in live]
    order = torch.randperm(sum(blocks) + 2, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    table = torch.zeros(len(live), max(blocks), dtype=torch.int32)
    cache = torch.zeros(sum(blocks) + 2, KV_HEADS, 2 * BLOCK, HEAD_SIZE, dtype=query.dtype)
    k_cache, v_cache = cache.chunk(2, dim=2)
    used = 0
    for i, r in enumerate(live):
        table[i, :blocks[i]] = order[used:used + blocks[i]]
        used += blocks[i]
        pos = torch.arange(len(keys[r]))
        slots = table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK
        ops.cpu_attn_reshape_and_cache(keys[r], values[r], k_cache, v_cache, slots, isa)
    q_lens = (starts[1:] - starts[:-1])[live]
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), q_lens.cumsum(0).to(torch.int32)])
    lens = seq_lens[live]
    meta = ops.cpu_attn_get_scheduler_metadata(len(live), HEADS, KV_HEADS, HEAD_SIZE, lens, query.dtype, cu,
                                               True, -1, isa, envs.VLLM_CPU_ATTN_SPLIT_KV)
    out = torch.full_like(query, float("nan"))
    rows = int(starts[-1])
    ops.cpu_attention_with_kv_cache(query[:rows], k_cache, v_cache, out[:rows], cu, lens, HEAD_SIZE ** -0.5,
                                    True, None, -1, table, 0.0, meta, None)
    return out


def _slots(keys, values, dtype):
    """A slot cache in the backend's layout (K|V per head in one row) holding the K/V in shuffled
    slots, and its slot table."""
    total = sum(len(k) for k in keys)
    rows = torch.zeros(total + 5, KV_HEADS, 2 * HEAD_SIZE, dtype=dtype)
    k_cache, v_cache = rows[..., :HEAD_SIZE], rows[..., HEAD_SIZE:]
    order = torch.randperm(total + 5, generator=torch.Generator().manual_seed(1)).to(torch.int32)
    table = torch.full((len(keys) + 1, max(len(k) for k in keys) + 4), 7, dtype=torch.int32)
    used = 0
    for r, (k, v) in enumerate(zip(keys, values)):
        table[r, :len(k)] = order[used:used + len(k)]
        k_cache[table[r, :len(k)].long()], v_cache[table[r, :len(k)].long()] = k, v
        used += len(k)
    return k_cache, v_cache, table


CASES = {
    "decodes": [(1, 300), (1, 700), (1, 41), (1, 1000), (1, 1)],
    "a lone long decode (split across threads)": [(1, 1500)],
    "prefill": [(400, 400)],
    "chunked prefill after cached context": [(200, 900), (37, 37)],
    "mixed step, a request with no queries": [(1, 250), (90, 90), (0, 60), (1, 17), (64, 300)],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "float32"])
@pytest.mark.parametrize("name", list(CASES))
def test_outputs_are_stock_cpu_kernels_bits(ops, name, dtype):
    keys, values, query, starts, seq_lens = _case(CASES[name], dtype, seed=len(name))
    stock = _stock(ops, keys, values, query, starts, seq_lens)
    k_cache, v_cache, table = _slots(keys, values, dtype)
    assert vllm_cpu_kernel.serves(query, k_cache, None) == (dtype == torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    assert vllm_cpu_kernel.attend(query, k_cache, v_cache, table, starts, seq_lens, HEAD_SIZE ** -0.5, out)
    rows = int(starts[-1])
    assert torch.equal(out[:rows], stock[:rows]), f"{(out[:rows] != stock[:rows]).float().mean():.2%} differ"
    assert out[rows:].isnan().all(), "padding rows are not written"
    # And it is attention: the torch path (float32 inside) agrees to bf16 rounding.
    torch_out = slot_attention_torch(query, k_cache, v_cache, table, starts, seq_lens, HEAD_SIZE ** -0.5,
                                     torch.full_like(query, float("nan")))
    tolerance = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out[:rows].float(), torch_out[:rows].float(), rtol=0, atol=tolerance)


def test_a_row_limit_inside_a_request_is_left_to_the_torch_path(ops):
    keys, values, query, starts, seq_lens = _case([(5, 20), (6, 6)], torch.bfloat16, seed=3)
    k_cache, v_cache, table = _slots(keys, values, torch.bfloat16)
    out = torch.full_like(query, float("nan"))
    assert not vllm_cpu_kernel.attend(query, k_cache, v_cache, table, starts, seq_lens, 0.125, out,
                                      num_actual_tokens=8)
    assert out.isnan().all(), "nothing written when the caller must run the torch path"
    # A limit at a request boundary: the first request's rows written, none past it.
    assert vllm_cpu_kernel.attend(query, k_cache, v_cache, table, starts, seq_lens, 0.125, out,
                                  num_actual_tokens=5)
    assert not out[:5].isnan().any() and out[5:].isnan().all()


def test_quantised_caches_and_float32_are_not_served(ops):
    query = torch.zeros(2, HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    cache = torch.zeros(4, KV_HEADS, HEAD_SIZE, dtype=torch.bfloat16)
    scales = KVScales(torch.ones(1), torch.ones(1))
    assert not vllm_cpu_kernel.serves(query, cache.to(torch.float8_e4m3fn), scales)
    assert not vllm_cpu_kernel.serves(query, cache.float(), None), "cache and query dtypes differ"
    assert not vllm_cpu_kernel.serves(query.float(), cache.float(), None), "float32 stays on torch"
    assert vllm_cpu_kernel.serves(query, cache, None)
