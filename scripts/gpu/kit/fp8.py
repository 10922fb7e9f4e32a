"""fp8 KV cache decode on the GPU: Proxima's slot kernel against FlashAttention 3, under CUDA-graph replay.

The graph-replayed decode grid (`cases.GRAPH_DECODE`), each point's batch (`cases.fp8_decode_batch`)
quantised to e4m3 with one per-tensor scale for K and one for V, as vLLM stores
``--kv-cache-dtype fp8``:

- Proxima fp8: bf16 queries over the fp8 slots, scales read in-kernel (as the backend runs it);
- FA3 fp8: as vLLM's FLASH_ATTN backend runs it, queries quantised to fp8 too (q_scale 1.0, vLLM's
  default without a calibrated checkpoint), k/v descales per (request, KV head);
- both bf16 kernels on the unquantised cache, for the fp8/bf16 speed-up of each.

Each kernel is replayed from a CUDA graph captured once (vLLM's decode steps); outputs are checked
against a float32 torch reference over the dequantised cache (Proxima) and against each other.
"""

from __future__ import annotations

import json

import torch

from kit.calls import fa3_decode, fa3_fp8_descales
from kit.cases import GRAPH_DECODE, K_SCALE, SCALE, V_SCALE, fp8_decode_batch, fp8_reference
from kit.layouts import HKV, HQ, D
from kit.timers import graph_us
from proxima.engine.attention.triton_attention import slot_attention_triton
from proxima.files import atomic_output


def fp8_case(batch: int, ctx: int) -> dict:
    b, rows8, k16, v16, q8, scales = fp8_decode_batch(batch, ctx)
    out = {name: torch.empty_like(b.q) for name in ("proxima_fp8", "fa3_fp8", "proxima_bf16", "fa3_bf16")}

    runs = {  # graph-safe: no host-side length hints, as during vLLM's capture
        "proxima_fp8": lambda: slot_attention_triton(b.q, rows8[..., :D], rows8[..., D:], b.slot_table,
                                                     b.cu_q, b.seq_lens, SCALE, out["proxima_fp8"],
                                                     kv_scales=scales),
        "fa3_fp8": fa3_decode(b, q8, k16, v16, out["fa3_fp8"], **fa3_fp8_descales(batch, scales)),
        "proxima_bf16": lambda: slot_attention_triton(b.q, b.rows[..., :D], b.rows[..., D:], b.slot_table,
                                                      b.cu_q, b.seq_lens, SCALE, out["proxima_bf16"]),
        "fa3_bf16": fa3_decode(b, b.q, b.k16, b.v16, out["fa3_bf16"]),
    }
    result = {"batch": batch, "context": ctx}
    for name, fn in runs.items():
        try:
            result[f"{name}_graph_us"] = graph_us(fn)
        except Exception as err:  # a kernel that does not run here is reported, not fatal
            result[f"{name}_error"] = f"{type(err).__name__}: {err}"[:200]
    # Oracle for Proxima fp8: the torch path in float32 over the dequantised slots.
    expected = fp8_reference(b, rows8, scales)
    result["proxima_fp8_vs_reference"] = float((out["proxima_fp8"].float() - expected.float()).abs().max())
    px = out["proxima_fp8"].float()
    result["proxima_fp8_vs_fa3_fp8"] = float((px - out["fa3_fp8"].float()).abs().max())
    result["proxima_fp8_vs_bf16"] = float((px - out["proxima_bf16"].float()).abs().max())
    result["kv_bytes_fp8"] = batch * ctx * HKV * D * 2
    return result


def _fmt(x) -> str:
    return f"{x:9.1f}" if isinstance(x, float) else f"{'-':>9}"


def run(json_path: str | None) -> None:
    """fp8 decode over GRAPH_DECODE under graph replay; every result to `json_path`."""
    print(f"device {torch.cuda.get_device_name()}; Hq={HQ} Hkv={HKV} D={D}; e4m3 KV, per-tensor scales "
          f"k={K_SCALE} v={V_SCALE}; CUDA-graph replay, median us")
    print(f"{'batch':>5} {'ctx':>6} {'px fp8':>9} {'fa3 fp8':>9} {'px bf16':>9} {'fa3 bf16':>9} "
          f"{'px/fa3 fp8':>10} {'px fp8/bf16':>11} {'fa3 fp8/bf16':>12} {'px-ref':>7} {'px-fa3':>7}")
    results = []
    for batch, ctx in GRAPH_DECODE:
        r = fp8_case(batch, ctx)
        torch.cuda.empty_cache()
        results.append(r)
        g = r.get

        def ratio(a: str, b: str, g=g) -> float:  # g bound now: called within this iteration anyway
            return g(a) / g(b) if g(a) and g(b) else float("nan")

        print(f"{batch:>5} {ctx:>6} {_fmt(g('proxima_fp8_graph_us'))} {_fmt(g('fa3_fp8_graph_us'))} "
              f"{_fmt(g('proxima_bf16_graph_us'))} {_fmt(g('fa3_bf16_graph_us'))} "
              f"{ratio('proxima_fp8_graph_us', 'fa3_fp8_graph_us'):>10.2f} "
              f"{ratio('proxima_fp8_graph_us', 'proxima_bf16_graph_us'):>11.2f} "
              f"{ratio('fa3_fp8_graph_us', 'fa3_bf16_graph_us'):>12.2f} "
              f"{r['proxima_fp8_vs_reference']:>7.4f} {r['proxima_fp8_vs_fa3_fp8']:>7.4f}")
        for key in [k for k in r if k.endswith("_error")]:
            print(f"      {key}: {r[key]}")
    if json_path:
        with atomic_output(json_path) as f:
            json.dump({"k_scale": K_SCALE, "v_scale": V_SCALE, "graph_decode": results}, f, indent=1)
