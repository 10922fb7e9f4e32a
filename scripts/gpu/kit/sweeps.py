"""Launch-shape sweeps: which tile shape and split count each case wants, under CUDA-graph replay.

Each sweep forces every shape of its grid through the launcher's own plan (`calls.forced`),
replays it from a CUDA graph (how vLLM runs decode steps, and `proxima serve`'s FULL graphs
mixed ones), checks it against FlashAttention 3 (or the fp8 oracle), reads the compiled kernel's
registers and spills, and reports the planner's own pick (`choose_launch_shape`) beside the best:

  decode_point      decode batches (bf16, fragmented slots), tiles x warps x stages x splits
  fp8_decode_point  e4m3 decode at the points furthest from FA3 fp8, the mixed plan's decode tile
  prefill_case      the MIXED cases (prefills, mixed steps, chunked prefill; gathered and dense-tile reads)
  prefill_stages    a quick check that this GPU ranks prefill pipeline depths as the sweep did
"""

from __future__ import annotations

import itertools
import json
import subprocess
from collections.abc import Callable, Iterable

import torch
import triton

from kit.calls import fa3_decode, fa3_fp8_descales, forced, kernels
from kit.cases import MIXED, decode_batch, fp8_decode_batch, fp8_reference, mixed_batch
from kit.layouts import D
from kit.timers import gpu_us, replay_us
from proxima.engine.attention.planning import TileConfig, choose_launch_shape, num_sms
from proxima.engine.attention.triton_attention import _launch_attention
from proxima.files import atomic_output

DECODE_POINTS = [(1, 2048), (1, 32768), (8, 8192), (8, 32768), (32, 2048), (32, 8192), (46, 300), (128, 1024),
                 (256, 2048)]
DECODE_SHAPES = [TileConfig(16, n, w, s) for n in (32, 64, 128)
                 for w, s in ((4, 2), (4, 3), (4, 4), (8, 2), (8, 3))]
DECODE_SPLITS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 64)
# bench_fp8.py had e4m3 decode at 0.86-1.21x FA3 fp8, the long contexts worst, while the bf16
# kernel is at parity there: an fp8 tile holds half the bytes, so bf16's shape need not suit it.
FP8_POINTS = [(8, 32768), (32, 8192), (8, 8192), (1, 32768), (46, 300)]
FP8_SHAPES = [TileConfig(64, 64, w, s, short_block_m=16, short_block_n=n)
              for n in (64, 128, 256) for w, s in ((4, 2), (4, 3), (4, 4), (8, 3), (8, 4))]
FP8_SPLITS = (1, 2, 4, 6, 8, 12, 16, 32)
PREFILL_SHAPES = [TileConfig(m, n, w, s, dense_kv=dense) for dense in (False, True) for m in (64, 128)
                  for n in (32, 64, 128) for w, s in ((4, 2), (4, 3), (8, 2), (8, 3))]
# sweep_prefill found 2 stages faster than 3 for 64x64 prefill tiles on one H200 and slower on another.
STAGE_SHAPES = [TileConfig(64, 64, 4, 2), TileConfig(64, 64, 4, 3), TileConfig(128, 64, 4, 3),
                TileConfig(64, 32, 4, 3)]
STAGE_CASES = ("prefill 1 x 4096", "chunked prefill 2048 over 6144", "prefill 16 x 256",
               "ample: 200 decodes + 1 prefill of 300")


def run_sweep(cases: Iterable[tuple], sweep: Callable[..., dict], report: Callable[[dict], None],
              json_path: str | None) -> None:
    """The device, then ``report(sweep(*case))`` per case as each finishes; every result to json_path."""
    sms = num_sms(torch.device("cuda"))
    print(f"device {torch.cuda.get_device_name()}, {sms} SMs; CUDA-graph replay, us")
    results = []
    for case in cases:
        results.append(sweep(*case))
        report(results[-1])
    if json_path:
        with atomic_output(json_path) as f:
            json.dump(results, f, indent=1)


def prefill_cases() -> Iterable[tuple[str, int]]:
    """(name, seed) of every MIXED case, seeded by its position."""
    return ((name, seed) for seed, name in enumerate(MIXED))


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


def decode_point(batch: int, ctx: int) -> dict:
    """One decode point: FA3, every (shape, split count) of the grid, and the planner's pick."""
    b = decode_batch(batch, ctx)
    out = {k: torch.empty_like(b.q) for k in ("proxima", "fa3", "triton")}
    launches = kernels(b, out, graph_safe=True)  # as captured: no length hints
    result = {"batch": batch, "context": ctx, "fa3_us": replay_us(launches["fa3"][1]), "runs": []}
    for tiles, splits in itertools.product(DECODE_SHAPES, DECODE_SPLITS):
        if splits > triton.cdiv(ctx, tiles.block_n):
            continue
        result["runs"].append({"block_n": tiles.block_n, "warps": tiles.num_warps, "stages": tiles.num_stages,
                               "splits": splits, **timed_run(b, out["proxima"], out["fa3"], tiles, splits)})
    # What slot_attention_triton itself picks for a captured decode graph, and its time.
    tiles, splits = choose_launch_shape(b.q, b.rows[:, :, : b.q.shape[2]], b.slot_table, b.cu_q, None, None)
    result["current"] = {"block_n": tiles.block_n, "warps": tiles.num_warps, "stages": tiles.num_stages,
                         "splits": splits, "us": replay_us(launches["proxima"][1])}
    return result


def fp8_decode_point(batch: int, ctx: int) -> dict:
    """One fp8 decode point: FA3 fp8, every (mixed-plan decode tile, split count), the pick."""
    b, rows8, k16, v16, q8, scales = fp8_decode_batch(batch, ctx)
    out, fa3_out = torch.empty_like(b.q), torch.empty_like(b.q)
    fa3 = fa3_decode(b, q8, k16, v16, fa3_out, **fa3_fp8_descales(batch, scales))
    expected = fp8_reference(b, rows8, scales)
    result = {"batch": batch, "context": ctx, "fa3_fp8_us": replay_us(fa3), "runs": []}
    for tiles, splits in itertools.product(FP8_SHAPES, FP8_SPLITS):
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


def launch_shape(b, tiles: TileConfig | None) -> tuple[TileConfig, int]:
    """The planner's (tiles, splits) for this batch with vLLM's hints; ``tiles`` forces the shape."""
    return choose_launch_shape(b.q, b.rows[:, :, : b.q.shape[2]], b.slot_table, b.cu_q, b.max_q, b.max_seq,
                               tiles=tiles)


def prefill_case(name: str, seed: int) -> dict:
    """One MIXED case: FA3, every shape of the prefill grid (with the planner's split count for
    it), and the planner's own pick."""
    b = mixed_batch(name, seed)
    out = {k: torch.empty_like(b.q) for k in ("proxima", "fa3", "triton")}
    launches = kernels(b, out)
    result = {"case": name, "fa3_us": replay_us(launches["fa3"][1]), "runs": []}
    for shape in PREFILL_SHAPES:
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


def prefill_shape_name(x: dict) -> str:
    dense = " dense" if x.get("dense") else ""
    return f"m{x['block_m']} n{x['block_n']} w{x['warps']} s{x['stages']} x{x['splits']}{dense}"


def report_case(r: dict) -> None:
    ok = [x for x in r["runs"] if "us" in x]
    best = min(ok, key=lambda x: x["us"])
    cur = r["current"]
    print(f"{r['case']}: FA3 {r['fa3_us']:.1f} | current {prefill_shape_name(cur)} {cur['us']:.1f} "
          f"({cur['us'] / r['fa3_us']:.2f}x FA3) | best {prefill_shape_name(best)} {best['us']:.1f} "
          f"({best['us'] / r['fa3_us']:.2f}x FA3) | max diff {max(x['max_abs_diff'] for x in ok):.4f}")
    for x in r["runs"]:
        detail = (f"{x['us']:8.1f} us; regs {x['regs']} spills {x['spills']}" if "us" in x
                  else f"error {x['error']}")
        print(f"      {prefill_shape_name(x)}: {detail}")


def prefill_stages() -> None:
    """Does this GPU rank prefill pipeline depths as the sweep did? Four shapes at four MIXED
    cases, replayed from CUDA graphs, in two passes (the second in reverse order, so drift
    shows), beside FlashAttention 3 (eager), through `calls.forced` (split count 1)."""
    query = "--query-gpu=name,clocks.sm,clocks.max.sm,power.limit,temperature.gpu"
    print(subprocess.run(["nvidia-smi", query, "--format=csv"], capture_output=True, text=True).stdout)
    for name in STAGE_CASES:
        b = mixed_batch(name, 3)
        out = {k: torch.empty_like(b.q) for k in ("proxima", "fa3", "triton")}
        line = [name, "fa3", round(gpu_us(kernels(b, out)["fa3"][1]), 1)]
        for shapes in (STAGE_SHAPES, STAGE_SHAPES[::-1]):
            for t in shapes:
                run, _ = forced(b, out["proxima"], t, 1)
                line += [f"m{t.block_m}n{t.block_n}s{t.num_stages}", round(replay_us(run), 1)]
        print(*line)
