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


# -- the int4 decode tile shape: which tile, warps and pipeline depth the quantised read wants --------

SWEEP_POINTS = [(128, 4096), (32, 8192), (8, 32768)]
SWEEP_SHAPES = [(n, w, s) for n in (16, 32, 64, 128) for w, s in ((4, 1), (4, 2), (4, 3), (8, 2), (8, 3))]


def sweep_point(batch: int, ctx: int, name: str = "int4_per_token_head") -> dict:
    """Every shape of SWEEP_SHAPES at the planner's split count, replayed from a graph: time,
    registers, spills and the largest difference from the planner's own launch."""
    from kit.timers import replay_us
    from proxima.engine.attention.planning import TileConfig, choose_launch_shape
    from proxima.engine.attention.triton_attention import _launch_attention, _launch_plan

    b = decode_batch(batch, ctx)
    cache = slot_cache(b, name)
    fa3_out, out, ref = (torch.empty_like(b.q) for _ in range(3))
    fa3 = fa3_decode(b, b.q, b.k16, b.v16, fa3_out)
    result = {"batch": batch, "context": ctx, "fa3_bf16_us": replay_us(fa3), "runs": []}
    planned, splits = choose_launch_shape(b.q, cache.k_codes, b.slot_table, b.cu_q, None, None)
    result["planned"] = {"block_n": planned.block_n, "warps": planned.num_warps, "stages": planned.num_stages,
                         "splits": splits,
                         "us": replay_us(proxima_call(b, cache, ref))}
    for n, w, s in SWEEP_SHAPES:
        tiles = TileConfig(16, n, w, s)
        try:
            plan = _launch_plan(b.q, cache.k_codes, cache.v_codes, b.slot_table, b.cu_q, b.seq_lens, SCALE,
                                out, b.q.shape[0], tiles, splits, cache)

            def run(plan=plan):
                for launch, grid, args, key, options in plan:
                    launch(grid, args, key, **options)

            us = replay_us(run)
            kernel = _launch_attention._compiled.get(plan[0][3])
            result["runs"].append({"block_n": n, "warps": w, "stages": s, "us": us,
                                   "regs": getattr(kernel, "n_regs", None),
                                   "spills": getattr(kernel, "n_spills", None),
                                   "max_abs_diff": float((out.float() - ref.float()).abs().max())})
        except Exception as err:
            error = f"{type(err).__name__}: {err}"[:160]
            result["runs"].append({"block_n": n, "warps": w, "stages": s, "error": error})
    return result


def run_sweep(json_path: str | None) -> None:
    results = []
    for batch, ctx in SWEEP_POINTS:
        r = sweep_point(batch, ctx)
        results.append(r)
        p = r["planned"]
        print(f"{batch} x {ctx}: FA3 bf16 {r['fa3_bf16_us']:.1f} us; planned 16x{p['block_n']} w{p['warps']} "
              f"s{p['stages']} splits {p['splits']}: {p['us']:.1f} us", flush=True)
        for x in sorted(r["runs"], key=lambda x: x.get("us", 1e9)):
            print(f"   16x{x['block_n']:<3} w{x['warps']} s{x['stages']}: "
                  + (f"{x['us']:8.1f} us ({x['us'] / r['fa3_bf16_us']:.2f}x FA3)  regs {x['regs']} spills "
                     f"{x['spills']}  diff {x['max_abs_diff']:.4f}" if "us" in x else x["error"]), flush=True)
    if json_path:
        with atomic_output(json_path) as f:
            json.dump(results, f, indent=1)
