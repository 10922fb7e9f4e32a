"""Prefill, mixed batches, host launch cost and CUDA-graph replay: Proxima against vLLM's kernels.

bench_decode.py times decode-only batches. A serving step at a tight KV budget is different: a
few prefills (new and recomputed requests) ride along with the decodes, and such mixed steps
run attention outside CUDA graphs (vLLM's default FULL_AND_PIECEWISE mode), so the host cost of
launching attention counts too. Per case this prints, for Proxima's Triton kernels, vLLM's
TRITON_ATTN (unified_attention) and FlashAttention 3, each with its KV write
(write_kv_triton / reshape_and_cache_flash):

- GPU time of attention alone (triton.testing.do_bench median);
- GPU time of write + attention;
- host time to enqueue write + attention once (the loop's wall time with the GPU left to trail
  behind; what a step pays per layer when attention runs eagerly).

- GPU time of attention replayed from a CUDA graph captured without host hints, as `proxima
  serve`'s FULL graphs capture and then replay mixed steps.

The decode section times the same kernels replayed from a CUDA graph (how vLLM runs decode-only
steps), which removes launch overhead from the comparison; Proxima's column is the plan a capture
gets (the mixed plan, since the graph may replay any batch), with the decode-only plan beside it.

`--guard FILE` compares the Proxima/FA3 ratios of this run with recorded ones and exits 1 when a
case is more than 10% worse (scripts/gpu/ratio_guard.py); `--record FILE` writes them.

usage: python scripts/gpu/bench_mixed.py [--json OUT] [--guard FILE | --record FILE]
       (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, replace
from unittest import mock

import ratio_guard  # scripts/gpu/ratio_guard.py
import torch
import triton.testing
from layouts import BLOCK, DTYPE, HKV, HQ, D, kv_layouts  # scripts/gpu/layouts.py

from proxima.engine.attention import planning
from proxima.engine.attention.triton_attention import slot_attention_triton
from proxima.engine.attention.triton_write_kv import write_kv_triton
from proxima.files import atomic_output

SCALE = D ** -0.5


def _serving_mix(decodes: int, ctx: tuple[int, int], prefills: list[tuple[int, int]], seed: int):
    rng = random.Random(seed)
    return [(1, rng.randint(*ctx)) for _ in range(decodes)] + prefills


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
GRAPH_DECODE = [(1, 2048), (1, 32768), (8, 8192), (8, 32768), (32, 2048), (32, 8192), (46, 300), (128, 1024),
                (256, 2048), (512, 1024)]


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


def kernels(b: Batch, out: dict[str, torch.Tensor], graph_safe: bool = False):
    """name -> (write, attend) callables. ``graph_safe`` drops the host-side hints (as in capture)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    one = torch.ones(1, device="cuda", dtype=torch.float32)
    k_rows, v_rows = b.rows[:, :, :D], b.rows[:, :, D:]
    hints = {} if graph_safe else {"max_query_len": b.max_q, "max_seq_len": b.max_seq}

    def vllm_write():
        ops.reshape_and_cache_flash(b.key, b.value, b.k16, b.v16, b.slot_mapping16, "auto", one, one)

    return {
        "proxima": (
            lambda: write_kv_triton(b.key, b.value, k_rows, v_rows, b.slot_mapping),
            lambda: slot_attention_triton(b.q, k_rows, v_rows, b.slot_table, b.cu_q, b.seq_lens, SCALE,
                                          out["proxima"], **hints),
        ),
        "fa3": (
            vllm_write,
            lambda: flash_attn_varlen_func(b.q, b.k16, b.v16, max_seqlen_q=b.max_q, cu_seqlens_q=b.cu_q,
                                           max_seqlen_k=b.max_seq, seqused_k=b.seq_lens, softmax_scale=SCALE,
                                           causal=True, block_table=b.block_table, out=out["fa3"],
                                           fa_version=3),
        ),
        "triton": (
            vllm_write,
            lambda: unified_attention(b.q, b.k16, b.v16, out["triton"], b.cu_q, b.max_q, b.seq_lens,
                                      b.max_seq, SCALE, True, (-1, -1), b.block_table, 0.0, None, None,
                                      None),
        ),
    }


def gpu_us(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def graph_us(fn, warmup: int = 25, rep: int = 200) -> float:
    """GPU time of ``fn`` replayed from a CUDA graph (how vLLM runs decode steps), median us.

    One eager call first compiles and warms up outside the capture, as vLLM does before it
    captures a size."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=warmup, rep=rep, return_mode="median") * 1e3


def host_us(fn, n: int = 200) -> float:
    """Host time to enqueue ``fn`` once: the GPU is left to trail behind the loop."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / n * 1e6


def mixed_case(name: str, requests: list[tuple[int, int]], seed: int) -> dict:
    b = build(requests, seed, contiguous_slots=name.endswith("contiguous slots"))
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
    b = build([(1, ctx)] * batch, batch * 7919 + ctx)
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    guard = p.add_mutually_exclusive_group()
    guard.add_argument("--guard", default=None, help="recorded ratios to check this run against")
    guard.add_argument("--record", default=None, help="write this run's ratios here")
    p.add_argument("--include", default=None, help="bench_fp8.py's JSON, guarded with this run")
    args = p.parse_args()
    print(f"device {torch.cuda.get_device_name()}; bf16, Hq={HQ} Hkv={HKV} D={D}; vLLM at block {BLOCK}")
    print("\nMixed and prefill batches, per layer (us): attention GPU | write+attention GPU | "
          "write+attention host enqueue")
    print(f"{'case':<52} {'px attn':>8} {'fa3 attn':>8} {'tr attn':>8} | {'px step':>8} {'fa3 step':>8} "
          f"| {'px host':>8} {'fa3 host':>8} {'tr host':>8} "
          f"| {'px graph':>8} {'fa3 grph':>8} {'tr graph':>8} | maxdiff")
    mixed = []
    for i, (name, reqs) in enumerate(MIXED.items()):
        r = mixed_case(name, reqs, i + 1)
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
    if args.json:
        with atomic_output(args.json) as f:
            json.dump(run, f, indent=1)
    if args.include:
        with open(args.include) as f:
            run["fp8_graph_decode"] = json.load(f)["graph_decode"]
    measured = ratio_guard.ratios(run)
    if args.record:
        where = f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}"
        ratio_guard.save(args.record, measured, where)
        print(f"\nrecorded {len(measured)} ratios in {args.record}")
    if args.guard:
        text, passed = ratio_guard.report(ratio_guard.judge(measured, ratio_guard.load(args.guard)))
        print("\nProxima/FA3 ratios against " + args.guard + "\n" + text)
        sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
