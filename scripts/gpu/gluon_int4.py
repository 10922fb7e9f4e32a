"""The Gluon int4 decode kernel (proxima/engine/attention/gluon_int4_decode.py) on the GPU: its output
against the torch path over the dequantised slots (GQA/MHA, heads 64/128, decodes and longer queries in
one call, split and not), then decode under CUDA-graph replay against FA3 bf16, vLLM's own int4
kernel (TRITON_ATTN) and Proxima's Triton int4 kernel (``launch_args.INT4_DECODE`` "triton").

usage: python scripts/gpu/gluon_int4.py [--json OUT] [--quick]   (needs CUDA and vLLM 0.26)
       --quick: GQA 4 at head 128 only, the issue's points (64-256 requests, 1k-8k tokens); every
       variant (VARIANTS) either way
"""

from __future__ import annotations

import argparse
import json

import torch


def _case(hq: int, hkv: int, d: int, reqs: list[tuple[int, int]], gen: torch.Generator):
    from proxima.engine.attention import per_token_head as pth

    fmt = pth.PTH_FORMATS["int4_per_token_head"]
    num_slots = sum(s for _, s in reqs) + 37
    raw = torch.zeros(num_slots, 1, hkv, fmt.record_bytes(d), dtype=torch.uint8, device="cuda")
    cache = pth.cache_views(raw, fmt, hkv, d)
    k = torch.randn(num_slots, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(num_slots, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    pth.write(k, v, cache, torch.arange(num_slots, device="cuda"))
    perm = torch.randperm(num_slots, device="cuda", generator=gen).to(torch.int32)
    table = torch.full((len(reqs), max(s for _, s in reqs) + 5), 10**6, dtype=torch.int32, device="cuda")
    at = 0
    for r, (_, s) in enumerate(reqs):
        table[r, :s] = perm[at:at + s]
        at += s
    cu = torch.tensor([0, *torch.tensor([q for q, _ in reqs]).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")
    seq_lens = torch.tensor([s for _, s in reqs], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    return q, cache, table, cu, seq_lens


def correctness(quick: bool) -> list[dict]:
    from proxima.engine.attention import launch_args
    from proxima.engine.attention.reference import slot_attention_torch
    from proxima.engine.attention.triton_attention import slot_attention_triton

    rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for hq, hkv, d in ((32, 8, 128),) if quick else ((32, 8, 128), (8, 8, 128), (24, 8, 64)):
        for reqs in ([(1, 1), (1, 17), (1, 300), (1, 1000)], [(2, 50), (4, 129), (1, 64), (3, 3), (40, 90)]):
            q, cache, table, cu, seq_lens = _case(hq, hkv, d, reqs, gen)
            scale = d ** -0.5
            expected = torch.empty(q.shape, dtype=torch.float32, device="cuda")
            slot_attention_torch(q.float(), cache.k_codes, cache.v_codes, table, cu, seq_lens, scale,
                                 expected, kv_scales=cache)
            row = {"hq": hq, "hkv": hkv, "d": d, "reqs": reqs}
            for kernel in ("gluon", "triton"):
                launch_args.INT4_DECODE = kernel
                for hint in (None,):  # no hint: splits from the table width (a few requests: split)
                    out = torch.full_like(q, float("nan"))
                    try:
                        slot_attention_triton(q, cache.k_codes, cache.v_codes, table, cu, seq_lens, scale,
                                              out, kv_scales=cache, max_seq_len=hint)
                        torch.cuda.synchronize()
                        row[f"{kernel}_{hint}"] = float((out.float() - expected).abs().max())
                    except Exception as e:  # reported, not fatal
                        row[f"{kernel}_{hint}"] = f"{type(e).__name__}: {e}"[:300]
            launch_args.INT4_DECODE = "gluon"
            print(row, flush=True)
            rows.append(row)
    return rows


# (warps a program, KV tiles its loads run ahead, tiles a softmax update): the served one first.
# prefetch None: gluon_int4_decode.prefetch_for's; 0: each tile its own loads, four programs an SM;
# step 2 (prefetch 0): two tiles' loads at once, one softmax update for both (168 registers, capped;
# not served: never clearly best on the 2026-12-07 H100 grid).
# (8 warps, 2 tiles) lost to 4 warps at every point of the 2026-12-06 H200 grid.
VARIANTS = [(4, None, 1), (4, 2, 1), (4, 1, 1), (4, 0, 1), (4, 0, 2)]


def timing(quick: bool) -> list[dict]:
    from kit import pth as kp
    from kit.calls import fa3_decode
    from kit.cases import PTH_DECODE, decode_batch
    from kit.timers import graph_us

    from proxima.engine.attention import gluon_int4_decode as gd
    from proxima.engine.attention import launch_args

    served = (gd.NUM_WARPS, gd.PREFETCH, gd.TILES_A_STEP)  # PREFETCH None: chosen per launch
    rows = []
    print(f"device {torch.cuda.get_device_name()}; graph replay, median us; gluon variants (warps, prefetch)")
    names = ["triton"] + [f"gluon w{w} pf{'auto' if p is None else p}{' x2' if t == 2 else ''}"
                          for w, p, t in VARIANTS]
    print(f"{'batch':>5} {'ctx':>6} {'fa3':>8} {'stock int4':>10} " + " ".join(f"{n:>13}" for n in names)
          + "  best/fa3 served/fa3 served/triton served/stock max|served-triton|")
    points = [(b, c) for b, c in PTH_DECODE if b >= 64 and 1024 <= c <= 8192] if quick else PTH_DECODE
    for batch, ctx in points:
        b = decode_batch(batch, ctx)
        cache = kp.slot_cache(b, "int4_per_token_head")
        fa3 = graph_us(fa3_decode(b, b.q, b.k16, b.v16, torch.empty_like(b.q)))
        try:  # vLLM's TRITON_ATTN int4 kernel (its query and output rotations, outside it, not timed)
            stock = graph_us(kp.stock_call(b, "int4_per_token_head", kp.stock_cache(b, "int4_per_token_head"),
                                           torch.empty_like(b.q)))
        except Exception as e:  # reported, not fatal
            print(f"   stock int4: {type(e).__name__}: {e}"[:300], flush=True)
            stock = float("nan")
        torch.cuda.empty_cache()
        outs, us = {}, {}
        for name in names:
            launch_args.INT4_DECODE = "triton" if name == "triton" else "gluon"
            if name != "triton":
                gd.NUM_WARPS, gd.PREFETCH, gd.TILES_A_STEP = VARIANTS[names.index(name) - 1]
            outs[name] = torch.empty_like(b.q)
            try:
                us[name] = graph_us(kp.proxima_call(b, cache, outs[name]))
            except Exception as e:  # reported, not fatal
                print(f"   {name}: {type(e).__name__}: {e}"[:300], flush=True)
                us[name] = float("nan")
        launch_args.INT4_DECODE = "gluon"
        gd.NUM_WARPS, gd.PREFETCH, gd.TILES_A_STEP = served
        gl_served = names[1]
        err = float((outs[gl_served].float() - outs["triton"].float()).abs().max())
        best = min(us[n] for n in names[1:])
        rows.append({"batch": batch, "ctx": ctx, "fa3_us": fa3, "stock_int4_us": stock, "us": us,
                     "max_abs_diff": err})
        print(f"{batch:>5} {ctx:>6} {fa3:8.1f} {stock:10.1f} " + " ".join(f"{us[n]:13.1f}" for n in names)
              + f"  {best / fa3:8.2f} {us[gl_served] / fa3:10.2f} {us[gl_served] / us['triton']:13.2f}"
              f" {us[gl_served] / stock:12.2f} {err:.4f}", flush=True)
        del b, cache
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    result = {"correctness": correctness(args.quick), "timing": timing(args.quick)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
