"""fp8 decode launch-shape sweep on the GPU, at the decode points furthest from FA3 fp8.

bench_fp8.py has Proxima's e4m3 decode at 0.86-1.21x FA3 fp8 under CUDA-graph replay, the long
contexts worst (8 x 32,768: 1.21x), while the bf16 kernel is at FA3 parity there. An fp8 tile
holds half the bytes of a bf16 one, so the shape tuned for bf16 (128-token decode tiles, 4 warps,
3 stages) need not suit it. FULL graphs replay the mixed plan, so the swept shape is the mixed
plan's decode tile (its long tiles as served), for each split count below, forced through the
launcher's own plan over bench_fp8's quantised batch; FA3 fp8 is replayed beside it, and every
run is checked against the float32 reference over the dequantised cache.

usage: python scripts/gpu/sweep_fp8_decode.py [--json OUT]   (needs an sm89+ GPU and vLLM 0.26)
"""

from __future__ import annotations

import functools
import itertools

import torch
import triton
from bench_fp8 import fa3_decode, fa3_fp8_descales, fp8_decode_batch  # scripts/gpu/bench_fp8.py
from bench_mixed import SCALE  # scripts/gpu/bench_mixed.py
from layouts import D  # scripts/gpu/layouts.py
from sweep_decode import forced, replay_us, report_sweep, sweep_cli, timed_run  # scripts/gpu/sweep_decode.py

from proxima.engine.attention.planning import TileConfig, choose_launch_shape
from proxima.engine.attention.quant import dequantize
from proxima.engine.attention.reference import slot_attention_torch

POINTS = [(8, 32768), (32, 8192), (8, 8192), (1, 32768), (46, 300)]
SHAPES = [TileConfig(64, 64, w, s, short_block_m=16, short_block_n=n)
          for n in (64, 128, 256) for w, s in ((4, 2), (4, 3), (4, 4), (8, 3), (8, 4))]
SPLITS = (1, 2, 4, 6, 8, 12, 16, 32)


def sweep_point(batch: int, ctx: int) -> dict:
    b, rows8, k16, v16, q8, scales = fp8_decode_batch(batch, ctx)
    out, fa3_out = torch.empty_like(b.q), torch.empty_like(b.q)
    fa3 = fa3_decode(b, q8, k16, v16, fa3_out, **fa3_fp8_descales(batch, scales))
    deq = torch.cat([dequantize(rows8[..., :D], scales.k), dequantize(rows8[..., D:], scales.v)], dim=-1)
    expected = torch.empty(b.q.shape, dtype=torch.float32, device="cuda")
    slot_attention_torch(b.q.float(), deq[..., :D], deq[..., D:], b.slot_table, b.cu_q, b.seq_lens, SCALE,
                         expected)
    del deq
    result = {"batch": batch, "context": ctx, "fa3_fp8_us": replay_us(fa3), "runs": []}
    for tiles, splits in itertools.product(SHAPES, SPLITS):
        if splits > triton.cdiv(ctx, tiles.short_block_n):
            continue
        entry = {"block_n": tiles.short_block_n, "warps": tiles.num_warps, "stages": tiles.num_stages,
                 "splits": splits}
        entry.update(timed_run(b, out, expected, tiles, splits, rows=rows8, kv_scales=scales))
        result["runs"].append(entry)
    # What a FULL-graph capture gets today (no hints: the mixed plan), and its time.
    tiles, splits = choose_launch_shape(b.q, rows8[:, :, :D], b.slot_table, b.cu_q, None, None)
    run, _ = forced(b, out, tiles, splits, rows=rows8, kv_scales=scales)
    result["current"] = {"block_n": tiles.short_block_n, "warps": tiles.num_warps, "stages": tiles.num_stages,
                         "splits": splits, "us": replay_us(run)}
    return result


if __name__ == "__main__":
    sweep_cli(POINTS, sweep_point, functools.partial(report_sweep, reference="fa3_fp8_us", label="FA3 fp8"))
