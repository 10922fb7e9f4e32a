"""Decode attention, timed eagerly: Proxima's slot-table kernel against vLLM's own paged kernels.

The same KV tokens are laid out twice (kit/layouts.py): in 16-token blocks for vLLM's
TRITON_ATTN (unified_attention) and FlashAttention 3, with a random (fragmented) block table;
and as Proxima's per-token slots. Every kernel must produce the same output (checked), then each
is timed with triton.testing.do_bench (median). Bandwidth counts KV bytes read once plus Q and O;
the ceiling is a measured device-to-device copy.
"""

from __future__ import annotations

import json

import torch

from kit.calls import decode_calls
from kit.cases import DECODE_GRID
from kit.layouts import BLOCK, DTYPE, HKV, HQ, D, kv_layouts
from kit.timers import copy_bandwidth, gpu_us
from proxima.files import atomic_output


def case(batch: int, ctx: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(batch * 100003 + ctx)
    kv = kv_layouts(batch, ctx // BLOCK, gen)  # ctx is a multiple of BLOCK here
    q = torch.randn(batch, HQ, D, device="cuda", dtype=DTYPE, generator=gen)
    cu_q = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    outs = {name: torch.empty_like(q) for name in ("proxima", "triton", "fa3")}
    result = {"batch": batch, "context": ctx}
    for name, fn in decode_calls(q, kv, cu_q, seq_lens, ctx, outs).items():
        try:
            fn()
            torch.cuda.synchronize()
            result[f"{name}_us"] = gpu_us(fn)
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


def run(json_path: str | None) -> None:
    """The eager decode table over DECODE_GRID; every result to `json_path`."""
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; measured copy bandwidth {bw / 1e12:.2f} TB/s")
    results = []
    print(f"{'batch':>5} {'ctx':>6} {'proxima_us':>11} {'triton_us':>10} {'fa3_us':>8} "
          f"{'px/fa3':>7} {'px TB/s':>8} {'%copy':>6} {'maxdiff':>8}")
    for batch, ctx in DECODE_GRID:
        r = case(batch, ctx)
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
    if json_path:
        with atomic_output(json_path) as f:
            json.dump({"copy_bandwidth_Bps": bw, "results": results}, f, indent=1)
