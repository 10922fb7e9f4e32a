"""Does this GPU rank prefill pipeline depths as the sweep did? A quick check, ~20 s.

scripts/gpu/sweep_prefill.py found 2 stages faster than 3 for 64x64 prefill tiles on one H200
and slower on another (docs/benchmarks.md, "Prefill tile shape"). This times four shapes at four
of bench_mixed.py's cases on this machine, replayed from CUDA graphs, in two passes (the second
in reverse order, so drift shows), beside FlashAttention 3 (eager), through the same launch path
as the sweep (`sweep_decode.forced`, split count 1).

usage: python scripts/gpu/prefill_stages.py   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

import subprocess

import torch
from bench_mixed import MIXED, build, gpu_us, kernels  # scripts/gpu/bench_mixed.py
from sweep_decode import forced, replay_us  # scripts/gpu/sweep_decode.py

from proxima.engine.attention.planning import TileConfig

SHAPES = [TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 3), TileConfig(128, 64, 4, 3),
          TileConfig(64, 32, 4, 3)]
CASES = ("prefill 1 x 4096", "chunked prefill 2048 over 6144", "prefill 16 x 256",
         "ample: 200 decodes + 1 prefill of 300")


def main() -> None:
    query = "--query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu"
    print(subprocess.run(["nvidia-smi", query, "--format=csv"], capture_output=True, text=True).stdout)
    for name in CASES:
        b = build(MIXED[name], 3)
        out = {k: torch.empty_like(b.q) for k in ("proxima", "fa3", "triton")}
        line = [name, "fa3", round(gpu_us(kernels(b, out)["fa3"][1]), 1)]
        for shapes in (SHAPES, SHAPES[::-1]):
            for t in shapes:
                run, _ = forced(b, out["proxima"], t, 1)
                line += [f"m{t.block_m}n{t.block_n}s{t.num_stages}", round(replay_us(run), 1)]
        print(*line)


if __name__ == "__main__":
    main()
