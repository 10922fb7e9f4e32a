"""Prefill / mixed-batch tile sweep on the GPU: which tile shape a batch with long queries wants.

For each case of bench_mixed.py (serving-shaped mixed steps, prefills, a chunked prefill; Llama-3-8B
attention shapes, bf16, fragmented slots) this times Proxima's kernels replayed from a CUDA graph
for every tile shape in the grid below (query rows, KV tile, warps, pipeline stages; gathered, and
with dense-tile TMA reads, `TileConfig.dense_kv`, which apply on the contiguous-slot cases), each
with the split count the planner gives that shape, forced through the launcher's own launch plan, next
to FlashAttention 3 replayed the same way. It prints per case what `slot_attention_triton` picks
itself (`choose_launch_shape`, with vLLM's host hints) and its time, the best shape, and each
shape's time, registers and spills. Each forced launch is checked against FA3.

usage: python scripts/gpu/sweep_prefill.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

import torch
from bench_mixed import MIXED, build, kernels  # scripts/gpu/bench_mixed.py
from sweep_decode import forced, replay_us, sweep_cli, timed_run  # scripts/gpu/sweep_decode.py

from proxima.engine.attention.planning import TileConfig, choose_launch_shape

SHAPES = [TileConfig(m, n, w, s, dense_kv=dense) for dense in (False, True) for m in (64, 128)
          for n in (32, 64, 128) for w, s in ((4, 2), (4, 3), (8, 2), (8, 3))]


def launch_shape(b, tiles: TileConfig | None) -> tuple[TileConfig, int]:
    """The planner's (tiles, splits) for this batch with vLLM's hints; ``tiles`` forces the shape."""
    return choose_launch_shape(b.q, b.rows[:, :, : b.q.shape[2]], b.slot_table, b.cu_q, b.max_q, b.max_seq,
                               tiles=tiles)


def sweep_case(name: str, requests: list[tuple[int, int]], seed: int) -> dict:
    b = build(requests, seed, contiguous_slots=name.endswith("contiguous slots"))  # as bench_mixed's cases
    out = {k: torch.empty_like(b.q) for k in ("proxima", "fa3", "triton")}
    launches = kernels(b, out)
    result = {"case": name, "fa3_us": replay_us(launches["fa3"][1]), "runs": []}
    for shape in SHAPES:
        tiles, splits = launch_shape(b, shape)
        entry = {"block_m": tiles.block_m, "block_n": tiles.block_n, "warps": tiles.num_warps,
                 "stages": tiles.num_stages, "splits": splits, "dense": tiles.dense_kv}
        entry.update(timed_run(b, out["proxima"], out["fa3"], tiles, splits))
        result["runs"].append(entry)
    tiles, splits = launch_shape(b, None)
    run, _ = forced(b, out["proxima"], tiles, splits)
    result["current"] = {"block_m": tiles.block_m, "block_n": tiles.block_n, "warps": tiles.num_warps,
                         "stages": tiles.num_stages, "splits": splits, "us": replay_us(run)}
    return result


def shape_name(x: dict) -> str:
    dense = " dense" if x.get("dense") else ""
    return f"m{x['block_m']} n{x['block_n']} w{x['warps']} s{x['stages']} x{x['splits']}{dense}"


def report_case(r: dict) -> None:
    ok = [x for x in r["runs"] if "us" in x]
    best = min(ok, key=lambda x: x["us"])
    cur = r["current"]
    print(f"{r['case']}: FA3 {r['fa3_us']:.1f} | current {shape_name(cur)} {cur['us']:.1f} "
          f"({cur['us'] / r['fa3_us']:.2f}x FA3) | best {shape_name(best)} {best['us']:.1f} "
          f"({best['us'] / r['fa3_us']:.2f}x FA3) | max diff {max(x['max_abs_diff'] for x in ok):.4f}")
    for x in r["runs"]:
        detail = (f"{x['us']:8.1f} us; regs {x['regs']} spills {x['spills']}" if "us" in x
                  else f"error {x['error']}")
        print(f"      {shape_name(x)}: {detail}")


if __name__ == "__main__":
    sweep_cli(((name, requests, seed) for seed, (name, requests) in enumerate(MIXED.items())),
              sweep_case, report_case)
