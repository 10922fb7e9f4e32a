"""The cases the GPU attention benchmarks measure, and the batches built for them.

Every bench and sweep draws its shapes from the tables here and builds its data with `build`
(one batch laid out twice: vLLM's 16-token paged blocks and Proxima's per-token slots, holding
the same values; kit/layouts.py) or `fp8_decode_batch` (the same, quantised to e4m3), so a case
means the same data in every script that measures it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
import triton

from kit.layouts import BLOCK, DTYPE, HQ, D, kv_layouts

SCALE = D ** -0.5


def _serving_mix(decodes: int, ctx: tuple[int, int], prefills: list[tuple[int, int]], seed: int):
    rng = random.Random(seed)
    return [(1, rng.randint(*ctx)) for _ in range(decodes)] + prefills


# Eager decode (bench_decode.py): (batch, context)
DECODE_GRID = [(1, 2048), (1, 32768), (8, 8192), (8, 32768), (32, 2048), (32, 8192), (128, 1024),
               (128, 4096), (256, 2048), (512, 1024)]
# Decode replayed from CUDA graphs (bench_mixed.py, bench_fp8.py): (batch, context)
GRAPH_DECODE = [(1, 2048), (1, 32768), (8, 8192), (8, 32768), (32, 2048), (32, 8192), (46, 300), (128, 1024),
                (256, 2048), (512, 1024)]
# Per-token-head KV decode (bench_pth.py): the graph grid, and the running batches a memory-bound
# server holds (>= 64 requests, 1k-8k context).
PTH_DECODE = GRAPH_DECODE + [(64, 1024), (64, 4096), (64, 8192), (128, 4096), (128, 8192), (256, 4096)]
# name: [(query length, sequence length incl. the queries)] per request
MIXED = {
    # The 1 GiB e2e run: ~46 running short chats, one new prompt (or recompute) per step.
    "tight: 46 decodes + 1 prefill of 150": _serving_mix(46, (60, 300), [(150, 150)], 1),
    "tight: 40 decodes + prefill 200 + chunk 120 over 200":
        _serving_mix(40, (60, 300), [(200, 200), (120, 320)], 2),
    "ample: 200 decodes + 1 prefill of 300": _serving_mix(200, (200, 600), [(300, 300)], 3),
    "prefill 1 x 4096": [(4096, 4096)],
    "prefill 4 x 1024": [(1024, 1024)] * 4,
    "prefill 16 x 256": [(256, 256)] * 16,
    "chunked prefill 2048 over 6144": [(2048, 8192)],
    # The same prompts on one ascending run of slots each (what the allocator hands a request whose
    # slots were freed together): how much of the prefill time is the per-token gather.
    "prefill 1 x 4096, contiguous slots": [(4096, 4096)],
    "chunked prefill 2048 over 6144, contiguous slots": [(2048, 8192)],
}

FP8 = torch.float8_e4m3fn
# The data is N(0, 1): |x| / 0.02 stays inside e4m3's +-448 for all but ~1e-6 of the values.
K_SCALE, V_SCALE = 0.02, 0.015


@dataclass
class Batch:
    """One batch laid out twice: 16-token paged blocks (vLLM) and per-token slots (Proxima)."""

    q: torch.Tensor
    key: torch.Tensor  # the batch's new tokens' K/V, already in both caches (the write re-writes them)
    value: torch.Tensor
    k16: torch.Tensor
    v16: torch.Tensor
    rows: torch.Tensor  # [slots, Hkv, 2D]: Proxima's cache, K|V halves side by side
    block_table: torch.Tensor
    slot_table: torch.Tensor
    slot_mapping16: torch.Tensor
    slot_mapping: torch.Tensor
    cu_q: torch.Tensor
    seq_lens: torch.Tensor
    max_q: int
    max_seq: int


def build(requests: list[tuple[int, int]], seed: int, contiguous_slots: bool = False) -> Batch:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    max_seq = max(s for _, s in requests)
    kv = kv_layouts(len(requests), triton.cdiv(max_seq, BLOCK), gen)
    k16, v16, block_table, rows, slot_table = kv.k16, kv.v16, kv.block_table, kv.rows, kv.slot_table
    # New tokens: the last q_len positions of each request.
    positions = [(r, p) for r, (q_len, seq) in enumerate(requests) for p in range(seq - q_len, seq)]
    req_idx = torch.tensor([r for r, _ in positions], device="cuda")
    pos_idx = torch.tensor([p for _, p in positions], device="cuda")
    slot_mapping16 = slot_table.long()[req_idx, pos_idx].contiguous()  # block * 16 + offset
    if contiguous_slots:  # the same tokens, moved so each request's slots ascend without a gap
        rows = rows[slot_table.flatten().long()].contiguous()
        slot_table = torch.arange(slot_table.numel(), device="cuda", dtype=torch.int32).view(slot_table.shape)
    slot_mapping = slot_table.long()[req_idx, pos_idx].contiguous()
    key = rows[slot_mapping, :, :D].clone()
    value = rows[slot_mapping, :, D:].clone()
    cu = [0]
    for q_len, _ in requests:
        cu.append(cu[-1] + q_len)
    return Batch(
        q=torch.randn(cu[-1], HQ, D, device="cuda", dtype=DTYPE, generator=gen), key=key, value=value,
        k16=k16, v16=v16, rows=rows, block_table=block_table, slot_table=slot_table,
        slot_mapping16=slot_mapping16, slot_mapping=slot_mapping,
        cu_q=torch.tensor(cu, device="cuda", dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in requests], device="cuda", dtype=torch.int32),
        max_q=max(q for q, _ in requests), max_seq=max_seq,
    )


def mixed_batch(name: str, seed: int) -> Batch:
    """The batch of MIXED[name] (its "contiguous slots" cases on one ascending run each)."""
    return build(MIXED[name], seed, contiguous_slots=name.endswith("contiguous slots"))


def decode_batch(batch: int, ctx: int) -> Batch:
    """A graph-replayed decode point's batch (GRAPH_DECODE), seeded by the point."""
    return build([(1, ctx)] * batch, batch * 7919 + ctx)


def fp8_decode_batch(batch: int, ctx: int):
    """The decode batch at this point, and its e4m3 copies: Proxima's slot rows, FA3's paged
    blocks, the queries FA3 quantises (q_scale 1.0), and the per-tensor scales."""
    from proxima.engine.attention.quant import KVScales, quantize_fp8

    b = decode_batch(batch, ctx)
    k_scale = torch.tensor(K_SCALE, device="cuda")
    v_scale = torch.tensor(V_SCALE, device="cuda")
    rows8 = torch.empty(b.rows.shape, dtype=FP8, device="cuda")
    rows8[..., :D] = quantize_fp8(b.rows[..., :D], k_scale, FP8)
    rows8[..., D:] = quantize_fp8(b.rows[..., D:], v_scale, FP8)
    k16 = quantize_fp8(b.k16, k_scale, FP8)
    v16 = quantize_fp8(b.v16, v_scale, FP8)
    q8 = b.q.float().clamp(-448.0, 448.0).to(FP8)
    return b, rows8, k16, v16, q8, KVScales(k_scale, v_scale)


def fp8_reference(b: Batch, rows8: torch.Tensor, scales) -> torch.Tensor:
    """The float32 torch oracle over the dequantised fp8 slots (what Proxima fp8 must match)."""
    from proxima.engine.attention.quant import dequantize
    from proxima.engine.attention.reference import slot_attention_torch

    deq = torch.cat([dequantize(rows8[..., :D], scales.k), dequantize(rows8[..., D:], scales.v)], dim=-1)
    expected = torch.empty(b.q.shape, dtype=torch.float32, device="cuda")
    slot_attention_torch(b.q.float(), deq[..., :D], deq[..., D:], b.slot_table, b.cu_q, b.seq_lens, SCALE,
                         expected)
    return expected
