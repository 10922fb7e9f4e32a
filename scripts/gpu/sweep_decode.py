"""Decode launch-shape sweep on the GPU: which tile shape and split count a decode batch wants.

For each decode point (batch x context, Llama-3-8B attention shapes, bf16, fragmented slots)
this times Proxima's kernels replayed from a CUDA graph (how vLLM runs decode steps) for every
tile shape (KV tile, warps, pipeline stages; 16 query rows) and split count in the grids below,
forced through the launcher's own launch plan, next to FlashAttention 3 replayed the same way.
It prints the best shape per point, what `slot_attention_triton` picks itself
(`choose_launch_shape`) and its time, and each shape's registers and spills. Each forced launch
is checked against FA3.

usage: python scripts/gpu/sweep_decode.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable, Iterable

import torch
import triton
from bench_mixed import SCALE, build, graph_us, kernels  # scripts/gpu/bench_mixed.py

from proxima.engine.attention.planning import TileConfig, choose_launch_shape, num_sms
from proxima.engine.attention.triton_attention import _launch_attention, _launch_plan
from proxima.files import atomic_output

POINTS = [(1, 2048), (1, 32768), (8, 8192), (8, 32768), (32, 2048), (32, 8192), (46, 300), (128, 1024),
          (256, 2048)]
SHAPES = [TileConfig(16, n, w, s) for n in (32, 64, 128) for w, s in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))]
SPLITS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 64)


def replay_us(fn) -> float:
    # Short timings: a sweep replays hundreds of launch shapes.
    return graph_us(fn, warmup=10, rep=40)


def forced(b, out, tiles: TileConfig, splits: int, rows=None, kv_scales=None):
    """A launch of Proxima's kernels on batch ``b`` with this shape, through the launcher's own
    plan; returns it and the main kernel's compile key. ``rows``/``kv_scales``: another cache for
    the same slots (bench_fp8's e4m3 copy) and its scales."""
    d = b.q.shape[2]
    rows = b.rows if rows is None else rows
    plan = _launch_plan(b.q, rows[:, :, :d], rows[:, :, d:], b.slot_table, b.cu_q, b.seq_lens, SCALE, out,
                        b.q.shape[0], tiles, splits, kv_scales)

    def run():
        for launch, grid, args, key, options in plan:
            launch(grid, args, key, **options)

    return run, plan[0][3]


def timed_run(b, out, reference, tiles: TileConfig, splits: int, rows=None, kv_scales=None) -> dict:
    """One forced launch (``forced``) replayed: its time, its largest difference from ``reference``,
    its registers and spills; or the error that stopped it (e.g. a shape past shared memory)."""
    try:
        run, key = forced(b, out, tiles, splits, rows, kv_scales)
        us = replay_us(run)
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"[:160]}
    kernel = _launch_attention._compiled.get(key)
    return {"us": us, "max_abs_diff": float((out.float() - reference.float()).abs().max()),
            "regs": getattr(kernel, "n_regs", None), "spills": getattr(kernel, "n_spills", None)}


def sweep_cli(cases: Iterable[tuple], sweep: Callable[..., dict], report: Callable[[dict], None]) -> None:
    """The sweeps' command line (``--json OUT``): the device, then ``report(sweep(*case))`` per case
    as each finishes, and every result to OUT."""
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    sms = num_sms(torch.device("cuda"))
    print(f"device {torch.cuda.get_device_name()}, {sms} SMs; CUDA-graph replay, us")
    results = []
    for case in cases:
        results.append(sweep(*case))
        report(results[-1])
    if args.json:
        with atomic_output(args.json) as f:
            json.dump(results, f, indent=1)


def sweep_point(batch: int, ctx: int) -> dict:
    b = build([(1, ctx)] * batch, batch * 7919 + ctx)
    out = {k: torch.empty_like(b.q) for k in ("proxima", "fa3", "triton")}
    launches = kernels(b, out, graph_safe=True)  # as captured: no length hints
    result = {"batch": batch, "context": ctx, "fa3_us": replay_us(launches["fa3"][1]), "runs": []}
    for tiles, splits in itertools.product(SHAPES, SPLITS):
        if splits > triton.cdiv(ctx, tiles.block_n):
            continue
        result["runs"].append({"block_n": tiles.block_n, "warps": tiles.num_warps, "stages": tiles.num_stages,
                               "splits": splits, **timed_run(b, out["proxima"], out["fa3"], tiles, splits)})
    # What slot_attention_triton itself picks for a captured decode graph, and its time.
    tiles, splits = choose_launch_shape(b.q, b.rows[:, :, : b.q.shape[2]], b.slot_table, b.cu_q, None, None)
    result["current"] = {"block_n": tiles.block_n, "warps": tiles.num_warps, "stages": tiles.num_stages,
                         "splits": splits, "us": replay_us(launches["proxima"][1])}
    return result


def shape_name(x: dict) -> str:
    return f"n{x['block_n']} w{x['warps']} s{x['stages']} x{x['splits']}"


def report_sweep(r: dict, reference: str = "fa3_us", label: str = "FA3") -> None:
    """One decode point of a sweep: the planner's pick, the best run, and each shape's best split
    count beside its unsplit time, registers and spills; ``reference`` is the result's FA3 time."""
    ok = [x for x in r["runs"] if "us" in x]
    best = min(ok, key=lambda x: x["us"])
    cur, ref = r["current"], r[reference]
    print(f"{r['batch']:>4} x {r['context']:>6}: {label} {ref:7.1f} | current {shape_name(cur)} "
          f"{cur['us']:7.1f} ({cur['us'] / ref:.2f}x) | best {shape_name(best)} {best['us']:7.1f} "
          f"({best['us'] / ref:.2f}x {label}) | max diff {max(x['max_abs_diff'] for x in ok):.4f}")
    for shape in sorted({(x["block_n"], x["warps"], x["stages"]) for x in ok}):
        runs = [x for x in ok if (x["block_n"], x["warps"], x["stages"]) == shape]
        top = min(runs, key=lambda x: x["us"])
        print(f"      n{shape[0]:<3} w{shape[1]} s{shape[2]}: best x{top['splits']:<2} {top['us']:7.1f} us "
              f"(unsplit {next((x['us'] for x in runs if x['splits'] == 1), float('nan')):7.1f}); "
              f"regs {top['regs']} spills {top['spills']}")
    for x in r["runs"]:
        if "error" in x:
            print(f"      error {shape_name(x)}: {x['error']}")
            break


if __name__ == "__main__":
    sweep_cli(POINTS, sweep_point, report_sweep)
