"""Decode attention on the GPU: Proxima's slot-table kernel against vLLM's own paged kernels.

The same KV tokens are laid out twice: in 16-token blocks for vLLM's TRITON_ATTN
(unified_attention) and FlashAttention 3, with a random (fragmented) block table; and as
Proxima's per-token slots (slot = block * 16 + offset, K|V side by side per head). Every kernel
must produce the same output (checked), then each is timed with triton.testing.do_bench
(median). Bandwidth counts KV bytes read once plus Q and O; the ceiling is a measured
device-to-device copy.

usage: python scripts/gpu/bench_decode.py [--json OUT]   (needs CUDA and vLLM 0.26)
"""

from __future__ import annotations

import argparse
import json

import torch
import triton.testing
from layouts import BLOCK, DTYPE, HKV, HQ, D, kv_layouts  # scripts/gpu/layouts.py

from proxima.engine.attention.triton_attention import slot_attention_triton
from proxima.files import atomic_output

GRID = [(1, 2048), (1, 32768), (8, 8192), (8, 32768), (32, 2048), (32, 8192), (128, 1024),
        (128, 4096), (256, 2048), (512, 1024)]


def copy_bandwidth() -> float:
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def case(batch: int, ctx: int, fa3, unified) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + ctx)
    kv = kv_layouts(batch, ctx // BLOCK, gen)  # ctx is a multiple of BLOCK here
    k16, v16, block_table, rows, slot_table = kv.k16, kv.v16, kv.block_table, kv.rows, kv.slot_table
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE, generator=gen)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    scale = D ** -0.5
    outs = {name: torch.empty_like(q) for name in ("proxima", "triton", "fa3")}
    runs = {
        "proxima": lambda: slot_attention_triton(
            q, rows[:, :, :D], rows[:, :, D:], slot_table, cu_q, seq_lens, scale, outs["proxima"],
            max_query_len=1, max_seq_len=ctx),
        "fa3": lambda: fa3(q, k16, v16, max_seqlen_q=1, cu_seqlens_q=cu_q, max_seqlen_k=ctx,
                           seqused_k=seq_lens, softmax_scale=scale, causal=True, block_table=block_table,
                           out=outs["fa3"], fa_version=3),
        "triton": lambda: unified(q, k16, v16, outs["triton"], cu_q, 1, seq_lens, ctx, scale, True,
                                  (-1, -1), block_table, 0.0, None, None, None),
    }
    result = {"batch": batch, "context": ctx}
    for name, fn in runs.items():
        try:
            fn()
            torch.cuda.synchronize()
            result[f"{name}_us"] = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3
        except Exception as err:  # a vLLM kernel that does not run here is reported, not fatal
            result[f"{name}_error"] = f"{type(err).__name__}: {err}"[:200]
    ref = outs["fa3"] if "fa3_us" in result else outs["triton"]
    result["max_abs_diff"] = float((outs["proxima"].float() - ref.float()).abs().max())
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    io_bytes = kv_bytes + 2 * q.numel() * 2
    result["kv_bytes"] = kv_bytes
    if "proxima_us" in result:
        result["proxima_gbps"] = io_bytes / (result["proxima_us"] * 1e-6) / 1e9
    return result


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; measured copy bandwidth {bw / 1e12:.2f} TB/s")
    results = []
    print(f"{'batch':>5} {'ctx':>6} {'proxima_us':>11} {'triton_us':>10} {'fa3_us':>8} "
          f"{'px/fa3':>7} {'px TB/s':>8} {'%copy':>6} {'maxdiff':>8}")
    for batch, ctx in GRID:
        r = case(batch, ctx, flash_attn_varlen_func, unified_attention)
        torch.cuda.empty_cache()  # the case's caches were freed on return: give their memory back
        results.append(r)
        px, tr, fa = r.get("proxima_us"), r.get("triton_us"), r.get("fa3_us")
        ratio = px / fa if px and fa else float("nan")
        tbs = r.get("proxima_gbps", 0) / 1e3
        print(f"{batch:>5} {ctx:>6} {px or float('nan'):>11.1f} {tr or float('nan'):>10.1f} "
              f"{fa or float('nan'):>8.1f} {ratio:>7.2f} {tbs:>8.2f} {100 * tbs * 1e12 / bw:>5.0f}% "
              f"{r['max_abs_diff']:>8.4f}")
        for key in ("proxima_error", "triton_error", "fa3_error"):
            if key in r:
                print(f"      {key}: {r[key]}")
    if args.json:
        with atomic_output(args.json) as f:
            json.dump({"copy_bandwidth_Bps": bw, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
