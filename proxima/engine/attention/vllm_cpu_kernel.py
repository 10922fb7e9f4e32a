"""On CPU, attention over token slots by vLLM's own CPU kernel.

Layer: the CPU production path for an unquantised bf16 cache on a CPU with AMX, between the
backend and vLLM's C++ ops. Each step, every request's K/V is gathered through the slot table into
a scratch block cache in vLLM's CPU layout (``cpu_attn_reshape_and_cache`` packs it as that kernel
reads it), and ``cpu_attention_with_kv_cache`` attends over it with the ISA stock vLLM picks for
its default CPU block size. Why not torch: the same kernel is the same rounding, so a bf16 model
gives stock's bits, not two roundings of one exact value that part greedy answers wherever bf16
drift compounds (the torch path, float32 probabilities, matches 74-81% of stock's bf16 outputs:
docs/results/cpu-2026-12-05b/attention-bits.txt). End to end it runs at the torch path's speed
(SmolLM2-135M bf16: 0.85x stock's tok/s against 0.88x, docs/benchmarks.md). What is left to torch
(``reference.slot_attention_torch``): float32 and fp16 models (see ``serves``), quantised caches,
a CPU without AMX, a build of vLLM without its CPU ops (a CUDA build: CPU tensors there are
tests), and a step whose row limit cuts a request's rows.

Results do not depend on the scratch block size (the kernel's tiles are 32-token aligned whatever
the block), only on the ISA; the block size 32 wastes least scratch.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

from proxima.engine.attention.checks import check_attention_args
from proxima.engine.attention.reference import plan_rows
from proxima.engine.attention.slot_rows import gather_slots

SCRATCH_BLOCK = 32
STOCK_CPU_BLOCK = 128  # vLLM's default block size on CPU: the ISA is chosen as for it


@functools.cache
def _ops():
    """vLLM's custom ops with its CPU kernels loaded, or None where this build has none."""
    try:
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return None
        current_platform.import_kernels()
        if not hasattr(torch.ops._C, "cpu_attention_with_kv_cache"):
            return None
    except (ImportError, AttributeError, RuntimeError):
        return None
    return ops


@functools.cache
def _split_kv() -> bool:
    """vLLM's VLLM_CPU_ATTN_SPLIT_KV, as its CPU backend reads it (an environment lookup: read
    once, not per layer per step)."""
    from vllm import envs

    return envs.VLLM_CPU_ATTN_SPLIT_KV


@functools.cache
def isa(dtype: torch.dtype, head_size: int) -> str | None:
    """The ISA stock vLLM's CPU backend would run this model with, or None when it has no kernel."""
    if _ops() is None:
        return None
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        chosen = _get_attn_isa(dtype, STOCK_CPU_BLOCK, head_size, "auto")
    except NotImplementedError:
        return None
    if chosen == "amx":
        torch._C._cpu._init_amx()  # the OS permission for AMX tiles (idempotent)
    return chosen


def serves(query: Tensor, k_cache: Tensor, kv_scales) -> bool:
    """Whether this step's attention runs on vLLM's CPU kernel: CPU tensors, an unquantised
    cache of the query's dtype, and the AMX kernel (bf16 on a CPU with AMX tiles). Its float32
    kernel (ISA "vec") was slower end to end than the torch path (tiny model, 600-900-token
    prompts: 0.48x stock's tok/s against 0.58x), and float32 answers already equal stock's."""
    return (not query.is_cuda and kv_scales is None and k_cache.dtype == query.dtype
            and isa(query.dtype, query.shape[-1]) == "amx")


class _Scratch:
    """One scratch block cache per process, grown as needed: layers run one after another, and
    a buffer reused across them is not faulted in afresh at every call. Zeroed when allocated:
    the kernel reads a last block's positions past the sequence too (weighted 0), and 0 times
    a NaN bit pattern left in fresh memory is NaN; later calls leave finite K/V there."""

    buffer: Tensor | None = None

    @classmethod
    def blocks(cls, num_blocks: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> Tensor:
        need = num_blocks * num_kv_heads * 2 * SCRATCH_BLOCK * head_size
        if cls.buffer is None or cls.buffer.dtype != dtype or cls.buffer.numel() < need:
            cls.buffer = torch.zeros(need, dtype=dtype)
        return cls.buffer[:need].view(num_blocks, num_kv_heads, 2 * SCRATCH_BLOCK, head_size)


def attend(
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    scale: float,
    output: Tensor,
    num_actual_tokens: int | None = None,
) -> bool:
    """Attention of each request's new queries over its slots, by vLLM's CPU kernel; writes
    ``output`` (the contract of ``reference.slot_attention_torch``). Returns False, writing
    nothing, when the step's row limit cuts through a request's rows: the caller then runs the
    torch path, which writes exactly the rows below the limit."""
    ops = _ops()
    check_attention_args(query, k_cache, v_cache, slot_table, query_start_loc, seq_lens, output,
                         num_actual_tokens)
    starts, lens, q_lens, row_limit, active = plan_rows(query_start_loc, seq_lens, num_actual_tokens,
                                                        query.shape[0], slot_table.shape[1])
    active = np.flatnonzero(active)
    if active.size == 0:
        return True
    if int(starts[active[-1] + 1]) > row_limit:
        return False
    num_kv_heads, head_size = k_cache.shape[1], k_cache.shape[2]
    lens, q_lens = lens[active], q_lens[active]
    blocks = (lens + SCRATCH_BLOCK - 1) // SCRATCH_BLOCK
    first_block = np.concatenate([[0], np.cumsum(blocks)[:-1]])
    # Every active request's positions, in order: which request, which position, and where each
    # lands in the scratch.
    owner = np.repeat(np.arange(active.size), lens)
    positions = np.arange(owner.shape[0]) - np.repeat(np.cumsum(lens) - lens, lens)
    slots = slot_table[torch.from_numpy(active[owner]), torch.from_numpy(positions)].long()
    mapping = torch.from_numpy(first_block[owner] * SCRATCH_BLOCK + positions)
    keys, values = gather_slots(k_cache, v_cache, slots)
    scratch = _Scratch.blocks(int(blocks.sum()), num_kv_heads, head_size, k_cache.dtype)
    key_blocks, value_blocks = scratch.chunk(2, dim=2)
    chosen = isa(query.dtype, head_size)
    ops.cpu_attn_reshape_and_cache(keys, values, key_blocks, value_blocks, mapping, chosen)
    columns = np.arange(int(blocks.max()))
    block_table = torch.from_numpy(np.where(columns < blocks[:, None], first_block[:, None] + columns, 0)
                                   .astype(np.int32))
    cu_q = torch.from_numpy(np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32))
    kv_lens = torch.from_numpy(lens.astype(np.int32))
    first_row = int(starts[active[0]])
    num_rows = int(cu_q[-1])
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=active.size, num_heads=query.shape[1], num_kv_heads=num_kv_heads, head_dim=head_size,
        seq_lens=kv_lens, dtype=query.dtype, query_start_loc=cu_q, causal=True, sliding_window_size=-1,
        isa=chosen, enable_kv_split=_split_kv())
    ops.cpu_attention_with_kv_cache(
        query=query[first_row:first_row + num_rows], key_cache=key_blocks, value_cache=value_blocks,
        output=output[first_row:first_row + num_rows], query_start_loc=cu_q, seq_lens=kv_lens, scale=scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=block_table, softcap=0.0,
        scheduler_metadata=metadata, s_aux=None)
    return True

