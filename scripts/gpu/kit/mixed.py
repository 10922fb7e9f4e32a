"""Prefill, mixed batches, host launch cost and CUDA-graph replay: Proxima against vLLM's kernels.

A serving step at a tight KV budget is not decode-only: a few prefills (new and recomputed
requests) ride along with the decodes, and such mixed steps run attention outside CUDA graphs
(vLLM's default FULL_AND_PIECEWISE mode), so the host cost of launching attention counts too.
Per case of `cases.MIXED` this measures, for Proxima's Triton kernels, vLLM's TRITON_ATTN and
FlashAttention 3, each with its KV write: GPU time of attention alone, of write + attention, the
host time to enqueue write + attention once, and attention replayed from a CUDA graph captured
without host hints (as `proxima serve`'s FULL graphs capture mixed steps). The decode section
(`cases.GRAPH_DECODE`) replays the same kernels from CUDA graphs, how vLLM runs decode-only
steps; Proxima's column is the plan a capture gets (the mixed plan), the decode-only plan beside.

With a guard file it compares this run's Proxima/FA3 ratios with recorded ones (kit/ratio_guard.py).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from unittest import mock

import torch

from kit import ratio_guard
from kit.calls import kernels
from kit.cases import GRAPH_DECODE, MIXED, decode_batch, mixed_batch
from kit.layouts import BLOCK, HKV, HQ, D
from kit.timers import gpu_us, graph_us, host_us
from proxima.engine.attention import planning
from proxima.files import atomic_output


def mixed_case(name: str, seed: int) -> dict:
    requests = MIXED[name]
    b = mixed_batch(name, seed)
    out = {k: torch.empty_like(b.q) for k in ("proxima", "fa3", "triton")}
    result = {"case": name, "requests": len(requests), "query_tokens": int(b.q.shape[0]),
              "kv_tokens": sum(s for _, s in requests)}
    for kname, (write, attend) in kernels(b, out).items():
        try:
            write()
            attend()
            torch.cuda.synchronize()

            def step(write=write, attend=attend):
                write()
                attend()

            result[f"{kname}_attn_us"] = gpu_us(attend)
            result[f"{kname}_step_us"] = gpu_us(step)
            result[f"{kname}_host_us"] = host_us(step)
        except Exception as err:  # a vLLM kernel that does not run here is reported, not fatal
            result[f"{kname}_error"] = f"{type(err).__name__}: {err}"[:200]
    for kname, (_, attend) in kernels(b, out, graph_safe=True).items():
        try:
            result[f"{kname}_graph_us"] = graph_us(attend)
        except Exception as err:
            result[f"{kname}_graph_error"] = f"{type(err).__name__}: {err}"[:200]
    ref = out["fa3"] if "fa3_attn_us" in result else out["triton"]
    result["max_abs_diff"] = float((out["proxima"].float() - ref.float()).abs().max())
    # Dense-tile reads (TileConfig.dense_kv, not planned yet) on every case: the contiguous-slot
    # cases show what TMA loads gain, the scattered ones what the per-program run check costs.
    planned = planning.choose_tiles
    with mock.patch.object(planning, "choose_tiles", lambda *a: replace(planned(*a), dense_kv=True)):
        try:
            out["proxima"].fill_(float("nan"))
            result["proxima_dense_attn_us"] = gpu_us(kernels(b, out)["proxima"][1])
            result["proxima_dense_graph_us"] = graph_us(kernels(b, out, graph_safe=True)["proxima"][1])
            result["dense_max_abs_diff"] = float((out["proxima"].float() - ref.float()).abs().max())
        except Exception as err:
            result["proxima_dense_error"] = f"{type(err).__name__}: {err}"[:200]
    return result


def graph_case(batch: int, ctx: int) -> dict:
    b = decode_batch(batch, ctx)
    out = {k: torch.empty_like(b.q) for k in ("proxima", "fa3", "triton")}
    result = {"batch": batch, "context": ctx}
    for kname, (_, attend) in kernels(b, out, graph_safe=True).items():
        try:
            result[f"{kname}_graph_us"] = graph_us(attend)
            result[f"{kname}_eager_us"] = gpu_us(attend)
        except Exception as err:
            result[f"{kname}_error"] = f"{type(err).__name__}: {err}"[:200]
    # The decode-only plan, as a capture that knew its replays were decodes would get it.
    decode, _ = planning.choose_launch_shape(b.q, b.rows[:, :, :D], b.slot_table, b.cu_q, 1, ctx)
    with mock.patch.object(planning, "choose_tiles", lambda *_: decode):
        result["proxima_decode_plan_graph_us"] = graph_us(kernels(b, out, graph_safe=True)["proxima"][1])
    result["max_abs_diff"] = float((out["proxima"].float() - out["fa3"].float()).abs().max())
    return result


def _fmt(x) -> str:
    return f"{x:8.1f}" if isinstance(x, float) else f"{'-':>8}"


def run(json_path: str | None, guard: str | None, record: str | None, include: list[str] | None) -> int:
    """Both tables; the run's JSON to `json_path`; with `guard`, 1 when a ratio regressed."""
    print(f"device {torch.cuda.get_device_name()}; bf16, Hq={HQ} Hkv={HKV} D={D}; vLLM at block {BLOCK}")
    print("\nMixed and prefill batches, per layer (us): attention GPU | write+attention GPU | "
          "write+attention host enqueue")
    print(f"{'case':<52} {'px attn':>8} {'fa3 attn':>8} {'tr attn':>8} | {'px step':>8} {'fa3 step':>8} "
          f"| {'px host':>8} {'fa3 host':>8} {'tr host':>8} "
          f"| {'px graph':>8} {'fa3 grph':>8} {'tr graph':>8} | maxdiff")
    mixed = []
    for i, name in enumerate(MIXED):
        r = mixed_case(name, i + 1)
        mixed.append(r)
        g = r.get
        print(f"{name:<52} {_fmt(g('proxima_attn_us'))} {_fmt(g('fa3_attn_us'))} "
              f"{_fmt(g('triton_attn_us'))} | {_fmt(g('proxima_step_us'))} {_fmt(g('fa3_step_us'))} | "
              f"{_fmt(g('proxima_host_us'))} {_fmt(g('fa3_host_us'))} {_fmt(g('triton_host_us'))} | "
              f"{_fmt(g('proxima_graph_us'))} {_fmt(g('fa3_graph_us'))} {_fmt(g('triton_graph_us'))} | "
              f"{r['max_abs_diff']:.4f}")
        if "proxima_dense_attn_us" in r:
            print(f"      dense-tile reads: attn {r['proxima_dense_attn_us']:.1f} "
                  f"({r['proxima_dense_attn_us'] / g('fa3_attn_us', float('nan')):.2f}x FA3), graph "
                  f"{r['proxima_dense_graph_us']:.1f}, maxdiff {r['dense_max_abs_diff']:.4f}")
        for key in [k for k in r if k.endswith("_error")]:
            print(f"      {key}: {r[key]}")
    print("\nDecode, eager launch vs CUDA-graph replay (us; the split count is fixed at capture, as in vLLM)")
    print(f"{'batch':>5} {'ctx':>6} {'px eager':>8} {'px graph':>8} {'px dec.plan':>11} {'fa3 eager':>9} "
          f"{'fa3 graph':>9} {'tr graph':>8} {'px/fa3 graph':>12}")
    graphs = []
    for batch, ctx in GRAPH_DECODE:
        r = graph_case(batch, ctx)
        graphs.append(r)
        g = r.get
        px, fa3 = g("proxima_graph_us"), g("fa3_graph_us")
        ratio = px / fa3 if px and fa3 else float("nan")
        print(f"{batch:>5} {ctx:>6} {_fmt(g('proxima_eager_us'))} {_fmt(px)} "
              f"{_fmt(g('proxima_decode_plan_graph_us')):>11} {_fmt(g('fa3_eager_us')):>9} {_fmt(fa3):>9} "
              f"{_fmt(g('triton_graph_us'))} {ratio:>12.2f}")
        for key in [k for k in r if k.endswith("_error")]:
            print(f"      {key}: {r[key]}")
    run = {"mixed": mixed, "graph_decode": graphs}
    if json_path:
        with atomic_output(json_path) as f:
            json.dump(run, f, indent=1)
    for path in include or ():
        with open(path) as f:
            extra = json.load(f)
        if "pth_decode" in extra:  # bench_pth.py's
            run["pth_decode"] = extra["pth_decode"]
        else:  # bench_fp8.py's
            run["fp8_graph_decode"] = extra["graph_decode"]
    measured = ratio_guard.ratios(run)
    device = torch.cuda.get_device_name()
    if record:
        ratio_guard.save(record, device, measured, f"{device}, {time.strftime('%Y-%m-%d')}")
        print(f"\nrecorded {len(measured)} ratios for {device} in {record}")
    if guard:
        recorded = ratio_guard.load(guard, device)
        if recorded is None:
            print(f"\nno ratios recorded for {device} in {guard}: record this run's with "
                  f"`python3 scripts/gpu/bench_mixed.py --record {guard}` (and its --include files)")
            return 1
        text, passed = ratio_guard.report(ratio_guard.judge(measured, recorded))
        print(f"\nProxima/FA3 ratios against {guard} ({device})\n{text}")
        return 0 if passed else 1
    return 0
