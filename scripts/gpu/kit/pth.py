"""Per-token-head KV decode on the GPU (int4, int8): Proxima's slot kernel against FlashAttention 3
over bf16 and against vLLM's own TRITON_ATTN kernel over the same quantised cache, under CUDA-graph
replay.

At each point of `cases.PTH_DECODE` one decode batch (`cases.decode_batch`) is written three ways:
bf16 for FA3 (and Proxima bf16), vLLM's stock TRITON_ATTN layout (16-token blocks, records of
``[K codes | K scale | V codes | V scale]`` per head and position) and Proxima's slot records,
both through vLLM's own writer, so the two quantised caches hold the same bytes. Timed, each
replayed from a graph captured once:

- Proxima int4 (codes read as 32-bit words, the rotation fused into the kernel) and int8;
- stock int4 (and int8): vLLM's `unified_attention` with its per-token-head path, its 3-D (split)
  launch below 16 requests as TRITON_ATTN's metadata builder sets it (int4: with the query and
  output rotations vLLM runs around its kernel);
- FA3 bf16 and Proxima bf16 on the unquantised cache.

Outputs are checked: Proxima int4 against stock int4 (the same quantised values) and against
the torch path over the dequantised slots.
"""

from __future__ import annotations

import json

import torch

from kit.calls import fa3_decode
from kit.cases import PTH_DECODE, SCALE, decode_batch
from kit.layouts import BLOCK, HKV, HQ, D
from kit.timers import copy_bandwidth, graph_us
from proxima.engine.attention import per_token_head as pth
from proxima.engine.attention.reference import slot_attention_torch
from proxima.engine.attention.triton_attention import slot_attention_triton
from proxima.files import atomic_output

# TRITON_ATTN's metadata builder: the 3-D (split) kernel below this many requests (128 programs
# over 8 KV heads; the nearest CUDA-graph capture size), 16 softmax segments.
STOCK_3D_THRESHOLD, STOCK_SEGMENTS = 16, 16


def stock_cache(b, name: str):
    """vLLM's TRITON_ATTN per-token-head cache of the batch: codes views, scale views, written."""
    from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
        triton_reshape_and_cache_flash_per_token_head_quant,
    )
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    fmt = pth.PTH_FORMATS[name]
    codes = fmt.code_bytes(D)
    padded = codes + 4
    num_blocks = b.k16.shape[0]
    raw = torch.zeros(num_blocks, HKV, BLOCK, 2 * padded, dtype=torch.uint8, device="cuda")
    key_cache, value_cache = raw.transpose(1, 2).split(padded, dim=-1)
    if fmt.code_dtype == torch.int8:
        key_cache, value_cache = key_cache.view(torch.int8), value_cache.view(torch.int8)
    elif not fmt.packed:
        key_cache, value_cache = key_cache.view(fmt.code_dtype), value_cache.view(fmt.code_dtype)
    floats = torch.empty(0, dtype=torch.float32, device="cuda").set_(raw.untyped_storage())
    st = raw.stride()
    strides = (st[0] // 4, st[2] // 4, st[1] // 4)
    k_scale = floats.as_strided((num_blocks, BLOCK, HKV), strides, codes // 4)
    v_scale = floats.as_strided((num_blocks, BLOCK, HKV), strides, (padded + codes) // 4)
    slots = torch.arange(num_blocks * BLOCK, device="cuda")
    triton_reshape_and_cache_flash_per_token_head_quant(
        b.k16.reshape(-1, HKV, D), b.v16.reshape(-1, HKV, D), key_cache, value_cache, k_scale, v_scale,
        slots, kv_quant_mode=get_kv_quant_mode(name))
    return key_cache, value_cache, k_scale, v_scale


def stock_call(b, name: str, cache, out: torch.Tensor):
    """vLLM's TRITON_ATTN decode over its per-token-head cache, as its backend runs a step."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.v1.kv_cache_interface import get_kv_quant_mode

    key_cache, value_cache, k_scale, v_scale = cache
    segm = (torch.empty(STOCK_3D_THRESHOLD, HQ, STOCK_SEGMENTS, D, device="cuda"),
            torch.empty(STOCK_3D_THRESHOLD, HQ, STOCK_SEGMENTS, device="cuda"),
            torch.empty(STOCK_3D_THRESHOLD, HQ, STOCK_SEGMENTS, device="cuda"))
    return lambda: unified_attention(
        q=b.q, k=key_cache, v=value_cache, out=out, cu_seqlens_q=b.cu_q, max_seqlen_q=1,
        seqused_k=b.seq_lens, max_seqlen_k=b.max_seq, softmax_scale=SCALE, causal=True, window_size=(-1, -1),
        block_table=b.block_table, softcap=0.0, q_descale=None, k_descale=None, v_descale=None,
        seq_threshold_3D=STOCK_3D_THRESHOLD, num_par_softmax_segments=STOCK_SEGMENTS,
        softmax_segm_output=segm[0], softmax_segm_max=segm[1], softmax_segm_expsum=segm[2],
        kv_quant_mode=get_kv_quant_mode(name), k_scale_cache=k_scale, v_scale_cache=v_scale)


def slot_cache(b, name: str) -> pth.PTHCache:
    """Proxima's slot records of the batch, written by vLLM's writer on the slot views."""
    fmt = pth.PTH_FORMATS[name]
    raw = torch.zeros(b.rows.shape[0], 1, HKV, fmt.record_bytes(D), dtype=torch.uint8, device="cuda")
    cache = pth.cache_views(raw, fmt, HKV, D)
    pth.write(b.rows[..., :D], b.rows[..., D:], cache,
              torch.arange(b.rows.shape[0], device="cuda"))
    return cache


def proxima_call(b, cache: pth.PTHCache, out: torch.Tensor):
    return lambda: slot_attention_triton(b.q, cache.k_codes, cache.v_codes, b.slot_table, b.cu_q, b.seq_lens,
                                         SCALE, out, kv_scales=cache)


def pth_case(batch: int, ctx: int, names=("int4_per_token_head", "int8_per_token_head")) -> dict:
    b = decode_batch(batch, ctx)
    result: dict = {"batch": batch, "context": ctx}
    outs: dict[str, torch.Tensor] = {}

    def timed(key: str, fn) -> None:
        try:
            result[f"{key}_graph_us"] = graph_us(fn)
        except Exception as err:  # a kernel that does not run here is reported, not fatal
            result[f"{key}_error"] = f"{type(err).__name__}: {err}"[:300]

    outs["fa3_bf16"] = torch.empty_like(b.q)
    timed("fa3_bf16", fa3_decode(b, b.q, b.k16, b.v16, outs["fa3_bf16"]))
    outs["proxima_bf16"] = torch.empty_like(b.q)
    timed("proxima_bf16", lambda: slot_attention_triton(b.q, b.rows[..., :D], b.rows[..., D:], b.slot_table,
                                                         b.cu_q, b.seq_lens, SCALE, outs["proxima_bf16"]))
    for name in names:
        tag = name.split("_")[0]
        cache = slot_cache(b, name)
        outs[f"proxima_{tag}"] = torch.empty_like(b.q)
        timed(f"proxima_{tag}", proxima_call(b, cache, outs[f"proxima_{tag}"]))
        stock = stock_cache(b, name)
        outs[f"stock_{tag}"] = torch.empty_like(b.q)
        # vLLM's int4 path rotates the queries and the output itself, around its kernel.
        timed(f"stock_{tag}", stock_call(b, name, stock, outs[f"stock_{tag}"]))
        expected = torch.empty(b.q.shape, dtype=torch.float32, device="cuda")
        slot_attention_torch(b.q.float(), cache.k_codes, cache.v_codes, b.slot_table, b.cu_q, b.seq_lens,
                             SCALE, expected, kv_scales=cache)
        px = outs[f"proxima_{tag}"].float()
        result[f"proxima_{tag}_vs_reference"] = float((px - expected).abs().max())
        result[f"proxima_{tag}_vs_stock"] = float((px - outs[f"stock_{tag}"].float()).abs().max())
        result[f"kv_bytes_{tag}"] = batch * ctx * HKV * pth.PTH_FORMATS[name].record_bytes(D)
        del cache, stock
        torch.cuda.empty_cache()
    result["kv_bytes_bf16"] = batch * ctx * HKV * D * 2 * 2
    return result


def run(json_path: str | None) -> None:
    bandwidth = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()}; Hq={HQ} Hkv={HKV} D={D}; CUDA-graph replay, median us; "
          f"copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    cols = ("fa3_bf16", "proxima_bf16", "proxima_int4", "stock_int4", "proxima_int8", "stock_int8")
    print(f"{'batch':>5} {'ctx':>6} " + " ".join(f"{c:>12}" for c in cols)
          + f" {'px4/fa3':>8} {'px4/st4':>8} {'px8/st8':>8} {'px4 TB/s':>8} {'px4-ref':>8} {'px4-st4':>8}")
    results = []
    for batch, ctx in PTH_DECODE:
        r = pth_case(batch, ctx)
        results.append(r)
        g = r.get

        def ratio(a: str, b: str, g=g) -> float:
            x, y = g(f"{a}_graph_us"), g(f"{b}_graph_us")
            return x / y if x and y else float("nan")

        us = g("proxima_int4_graph_us")
        tbs = r["kv_bytes_int4"] / (us * 1e-6) / 1e12 if us else float("nan")
        print(f"{batch:>5} {ctx:>6} " + " ".join(f"{g(c + '_graph_us') or float('nan'):12.1f}" for c in cols)
              + f" {ratio('proxima_int4', 'fa3_bf16'):8.2f} {ratio('proxima_int4', 'stock_int4'):8.2f}"
              f" {ratio('proxima_int8', 'stock_int8'):8.2f} {tbs:8.2f}"
              f" {g('proxima_int4_vs_reference', float('nan')):8.4f}"
              f" {g('proxima_int4_vs_stock', float('nan')):8.4f}",
              flush=True)
        for key in [k for k in r if k.endswith("_error")]:
            print(f"      {key}: {r[key]}")
    if json_path:
        with atomic_output(json_path) as f:
            json.dump({"copy_bandwidth_bytes_s": bandwidth, "pth_decode": results}, f, indent=1)


# -- launch plans for decode under graph replay: which plan a captured decode step should run ----------

# Decode points, and one serving mix (46 decodes + a 150-token prefill) where the long launch works.
PLAN_POINTS = [(1, 2048), (8, 8192), (32, 8192), (46, 300), (128, 1024), (128, 4096), (256, 2048),
               (512, 1024)]
PLAN_MIXES = ["tight: 46 decodes + 1 prefill of 150"]


def _plans(cache_kind: str) -> dict:
    """Name -> (TileConfig, int4 rotation, int4 prefetch): what graphs captured today run (one
    launch of a mixed plan), the decode plan (a uniform-decode graph, ``graph_max_query_len``),
    mixed plans of two launches, and over int4 each with butterflies and with loads pipelined."""
    from dataclasses import replace

    from proxima.engine.attention.planning import TileConfig, _pth_tiles, cache_tiles, choose_tiles

    int4 = cache_kind == "int4"
    mixed = replace(cache_tiles(HQ // HKV, D, 2, None, int4), short_launch=None)
    # The decode plan as the planner builds it for bf16 (int4 plans now ignore the query-length hint
    # and serve decodes the mixed plan: this keeps the plan that replaced timed beside it).
    decode = choose_tiles(HQ // HKV, D, 2, 1)
    decode = _pth_tiles(decode, D, 2) if int4 else decode
    plans = {"mixed-1launch": (mixed, "matrix", False), "decode-plan": (decode, "matrix", False)}
    short = (mixed.short_block_m, mixed.short_block_n)
    for warps, stages in ((8, 1), (4, 1)) if int4 else ((4, 3), (8, 3)):
        two = replace(mixed, short_launch=TileConfig(*short, warps, stages))
        plans[f"mixed-2launch-w{warps}s{stages}"] = (two, "matrix", False)
    if int4:  # the same plans rotating by butterflies (triton_int4._fwht), then also prefetching
        plans |= {f"{name} fwht": (tiles, "butterfly", False) for name, (tiles, _, _) in plans.items()}
        plans |= {f"{name} fwht pf": (tiles, "butterfly", True) for name, (tiles, _, _) in plans.items()
                  if "fwht" not in name and "w4s1" not in name}
    return plans


def _int4_tile_plans() -> dict:
    """The served int4 plan (one mixed launch, 16 x 128 decode tiles, 4 warps) against narrower
    decode KV tiles, in one launch and in a short launch of their own (whose registers are not the
    long tiles'), and 2-warp short launches: which decode tile holds the most loads in flight per
    SM. All rotate by butterflies and pipeline their loads, as served."""
    from dataclasses import replace

    from proxima.engine.attention.planning import TileConfig, cache_tiles

    served = replace(cache_tiles(HQ // HKV, D, 2, None, True), short_launch=None)
    plans = {"served mixed-1launch n128 w4": (served, "butterfly", True)}
    for n in (64, 32):
        one = replace(served, short_block_n=n)
        plans[f"mixed-1launch n{n} w4"] = (one, "butterfly", True)
        for warps in (4, 2):
            two = replace(one, short_launch=TileConfig(served.short_block_m, n, warps, 1))
            plans[f"mixed-2launch n{n} w{warps}"] = (two, "butterfly", True)
    two = replace(served, short_launch=TileConfig(served.short_block_m, served.short_block_n, 4, 1))
    plans["mixed-2launch n128 w4"] = (two, "butterfly", True)
    return plans


def _plan_runs(b, k, v, kv_scales, out, plans: dict) -> dict:
    from proxima.engine.attention import launch_args
    from proxima.engine.attention.planning import choose_launch_shape
    from proxima.engine.attention.triton_attention import _launch_attention, _launch_plan

    runs = {}
    for name, (tiles, rotation, prefetch) in plans.items():
        try:
            _, splits = choose_launch_shape(b.q, k, b.slot_table, b.cu_q, None, None, tiles=tiles)
            # read into the plan's constexprs here
            launch_args.INT4_ROTATION, launch_args.INT4_PREFETCH = rotation, prefetch
            plan = _launch_plan(b.q, k, v, b.slot_table, b.cu_q, b.seq_lens, SCALE, out, b.q.shape[0], tiles,
                                splits, kv_scales)

            def run(plan=plan):
                for launch, grid, args, key, options in plan:
                    launch(grid, args, key, **options)

            us = graph_us(run)
            regs = [getattr(_launch_attention._compiled.get(p[3]), "n_regs", None) for p in plan
                    if p[0] is _launch_attention]
            runs[name] = {"us": us, "splits": splits, "regs": regs, "out": out.float().clone()}
        except Exception as err:
            runs[name] = {"error": f"{type(err).__name__}: {err}"[:200]}
    return runs


def plan_point(b, label: str, tile_sweep: bool = False) -> dict:
    """FA3 bf16 and stock int4 for reference; each plan over bf16 and over int4 (``tile_sweep``:
    the int4 tile plans only), replayed from a graph, and its largest difference from the first
    plan's output."""
    result: dict = {"case": label, "plans": {}}
    fa3_out = torch.empty_like(b.q)
    if b.max_q == 1:
        result["fa3_bf16_us"] = graph_us(fa3_decode(b, b.q, b.k16, b.v16, fa3_out))
        stock = stock_cache(b, "int4_per_token_head")
        stock_out = torch.empty_like(b.q)
        result["stock_int4_us"] = graph_us(stock_call(b, "int4_per_token_head", stock, stock_out))
        del stock
    cache = slot_cache(b, "int4_per_token_head")
    kinds = {"bf16": (b.rows[..., :D], b.rows[..., D:], None), "int4": (cache.k_codes, cache.v_codes, cache)}
    for kind, (k, v, scales) in kinds.items():
        if tile_sweep and kind != "int4":
            continue
        plans = _int4_tile_plans() if tile_sweep else _plans(kind)
        runs = _plan_runs(b, k, v, scales, torch.empty_like(b.q), plans)
        base = runs.get(next(iter(plans)), {}).get("out")
        for name, r in runs.items():
            out = r.pop("out", None)
            if out is not None and base is not None:
                r["max_abs_diff"] = float((out - base).abs().max())
            result["plans"][f"{kind} {name}"] = r
    return result


def run_plans(json_path: str | None, tile_sweep: bool = False) -> None:
    """Time every plan at every point; ``tile_sweep``: the int4 decode tile shapes of
    ``_int4_tile_plans`` instead of ``_plans``."""
    from kit.cases import mixed_batch

    print(f"device {torch.cuda.get_device_name()}; Hq={HQ} Hkv={HKV} D={D}; CUDA-graph replay, median us")
    cases = [(f"{batch} x {ctx}", decode_batch(batch, ctx)) for batch, ctx in PLAN_POINTS]
    cases += [(name, mixed_batch(name, 1)) for name in PLAN_MIXES]
    results = []
    for label, b in cases:
        r = plan_point(b, label, tile_sweep)
        results.append(r)
        ref = " ".join(f"{k[:-3]} {r[k]:.1f}" for k in ("fa3_bf16_us", "stock_int4_us") if k in r)
        print(f"{label}: {ref}", flush=True)
        for name, x in r["plans"].items():
            if "us" not in x:
                print(f"   {name:32} {x['error']}", flush=True)
                continue
            vs = f" ({x['us'] / r['fa3_bf16_us']:.2f}x FA3)" if "fa3_bf16_us" in r else ""
            print(f"   {name:32} {x['us']:8.1f} us{vs}  splits {x['splits']}  regs {x['regs']}"
                  f"  diff {x.get('max_abs_diff', float('nan')):.4f}", flush=True)
        del b
        torch.cuda.empty_cache()
    if json_path:
        with atomic_output(json_path) as f:
            json.dump(results, f, indent=1)
