"""The calls the GPU benchmarks time: each attention implementation on one batch, as vLLM runs it.

`kernels` is the call table of a `cases.Batch` (Proxima's Triton kernels, vLLM's TRITON_ATTN and
FlashAttention 3, each with its KV write); `decode_calls` the same three on bare decode layouts;
`fa3_decode` FA3 as vLLM's FLASH_ATTN runs a decode step (bf16 or fp8); `forced` a launch of
Proxima's kernels with a chosen tile shape and split count, through the launcher's own plan.
vLLM is imported inside the functions (the entry scripts' --help runs without a GPU).
"""

from __future__ import annotations

import torch

from kit.cases import SCALE, Batch
from kit.layouts import HKV, D
from proxima.engine.attention.planning import TileConfig
from proxima.engine.attention.triton_attention import _launch_attention, _launch_plan, slot_attention_triton
from proxima.engine.attention.triton_write_kv import write_kv_triton


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


def decode_calls(q: torch.Tensor, kv, cu_q: torch.Tensor, seq_lens: torch.Tensor, ctx: int,
                 outs: dict[str, torch.Tensor]):
    """name -> attend, for one decode query per request over `kv` (layouts.KVLayouts), eager and
    with host hints, as bench_decode.py times them."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    rows = kv.rows
    return {
        "proxima": lambda: slot_attention_triton(
            q, rows[:, :, :D], rows[:, :, D:], kv.slot_table, cu_q, seq_lens, SCALE, outs["proxima"],
            max_query_len=1, max_seq_len=ctx),
        "fa3": lambda: flash_attn_varlen_func(q, kv.k16, kv.v16, max_seqlen_q=1, cu_seqlens_q=cu_q,
                                              max_seqlen_k=ctx, seqused_k=seq_lens, softmax_scale=SCALE,
                                              causal=True, block_table=kv.block_table, out=outs["fa3"],
                                              fa_version=3),
        "triton": lambda: unified_attention(q, kv.k16, kv.v16, outs["triton"], cu_q, 1, seq_lens, ctx, SCALE,
                                            True, (-1, -1), kv.block_table, 0.0, None, None, None),
    }


def fa3_decode(b: Batch, q, k, v, o, **descales):
    """FA3 over paged blocks, as vLLM's FLASH_ATTN runs a decode step (no host hints beyond b's)."""
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return lambda: flash_attn_varlen_func(
        q, k, v, max_seqlen_q=1, cu_seqlens_q=b.cu_q, max_seqlen_k=b.max_seq, seqused_k=b.seq_lens,
        softmax_scale=SCALE, causal=True, block_table=b.block_table, out=o, fa_version=3, **descales)


def fa3_fp8_descales(batch: int, scales) -> dict:
    shape = (batch, HKV)
    return {"q_descale": torch.ones((), device="cuda").expand(shape),
            "k_descale": scales.k.expand(shape), "v_descale": scales.v.expand(shape)}


def forced(b: Batch, out, tiles: TileConfig, splits: int, rows=None, kv_scales=None):
    """A launch of Proxima's kernels on batch ``b`` with this shape, through the launcher's own
    plan; returns it and the main kernel's compile key. ``rows``/``kv_scales``: another cache for
    the same slots (an e4m3 copy) and its scales."""
    d = b.q.shape[2]
    rows = b.rows if rows is None else rows
    plan = _launch_plan(b.q, rows[:, :, :d], rows[:, :, d:], b.slot_table, b.cu_q, b.seq_lens, SCALE, out,
                        b.q.shape[0], tiles, splits, kv_scales)

    def run():
        for launch, grid, args, key, options in plan:
            launch(grid, args, key, **options)

    # The main kernel's key: a plan of two launches starts with the longest query's.
    return run, next(entry[3] for entry in plan if entry[0] is _launch_attention)


def attention_impl(backend: str):
    """The attention implementation class an engine with this backend runs."""
    if backend == "CUSTOM":
        from proxima.engine.attention.backend import ProximaSlotAttentionImpl

        return ProximaSlotAttentionImpl
    if backend == "FLASH_ATTN":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl

        return FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    return TritonAttentionImpl
