"""Compile the attention kernel variants a server will need before it serves (no launch).

Layer: called by the backend on its first forward (vLLM's warm-up, before serving) with real
tensors; ``triton_attention._launch_plan`` builds the launches, so a warmed-up variant is exactly
the one a later call looks up.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import triton
from torch import Tensor

from proxima.engine.attention import gluon_int4_decode
from proxima.engine.attention.launch_args import interpreting, scale_args
from proxima.engine.attention.planning import MAX_SPLITS, TileConfig, cache_tiles, head_size_pad
from proxima.engine.attention.quant import KVScales
from proxima.engine.attention.triton_attention import _launch_plan

# Under "vllm." so the line lands in the server log with vLLM's own handlers and format.
logger = logging.getLogger(f"vllm.{__name__}")


def compile_attention_variants(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, output: Tensor, kv_scales: KVScales | None = None,
) -> int:
    """Compile, without launching, every kernel variant later calls with these tensors may need.

    Why: Triton compiles a variant at its first launch, and vLLM's own warm-up reaches only some
    of them: on the H200 (scripts/gpu/serve_bench.sh) vLLM's JIT monitor caught
    `_slot_attention_kernel` compiling under the first requests of `proxima serve`, whose TTFT
    p95 was 970 ms against stock's 200; with this warm-up (10 variants, 4.2 s at start-up) it
    caught none. The variants: decode and prefill tile shapes, each unsplit and
    split, and the merge kernel for every padded split count the slot table width allows.
    Nothing is launched, so this is safe anywhere but inside a CUDA-graph capture (the caller
    skips it there). Returns the number of variants compiled or loaded from Triton's disk cache.
    """
    _, num_query_heads, head_size = query.shape
    group = num_query_heads // k_cache.shape[1]
    padded = head_size_pad(head_size)
    int4_codes = k_cache.dtype == torch.uint8  # as planning.choose_launch_shape

    def plan(tiles: TileConfig, num_splits: int):
        # A one-token call: variants depend on dtypes, alignment, strides and constexprs, not sizes.
        return _launch_plan(query[:1], k_cache, v_cache, slot_table, query_start_loc[:2], seq_lens[:1], 1.0,
                            output[:1], 1, tiles, num_splits, kv_scales)

    max_splits = 1
    count = 0
    for max_query_len in (1, None):  # decode-only tiles, then the mixed plan's
        tiles = cache_tiles(group, padded, query.dtype.itemsize, max_query_len, int4_codes)
        kv_tiles = triton.cdiv(slot_table.shape[1], tiles.short_block_n or tiles.block_n)
        max_splits = max(max_splits, min(MAX_SPLITS, kv_tiles))
        for num_splits in (1, 2):  # every split count > 1 shares one main-kernel variant
            # The int4 decode kernel's depth follows the batch (gluon_int4_decode.prefetch_for).
            for prefetch in gluon_int4_decode.prefetch_choices(num_splits > 1):
                with _forced(gluon_int4_decode, "PREFETCH", prefetch):
                    entries = plan(tiles, num_splits)
                for launch, grid, args, key, options in entries:
                    count += launch.compile(grid, args, key, **options)
    # The merge kernel is compiled per padded split count (a constexpr).
    tiles = cache_tiles(group, padded, query.dtype.itemsize, 1, int4_codes)
    splits = 4
    while splits <= triton.next_power_of_2(max_splits):
        launch, grid, args, key, options = plan(tiles, splits)[-1]  # the merge: a plan's last launch
        count += launch.compile(grid, args, key, **options)
        splits *= 2
    return count


@contextlib.contextmanager
def _forced(module, name: str, value):
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


_precompiled_layouts: set[tuple] = set()


def precompile_attention_once(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, slot_table: Tensor, query_start_loc: Tensor,
    seq_lens: Tensor, output: Tensor, kv_scales: KVScales | None = None,
) -> bool:
    """`compile_attention_variants` once per tensor layout (all layers of a model share one).

    Returns False, doing nothing, inside a CUDA-graph capture (the caller tries again on a later
    call) and under the interpreter (nothing to compile); True once the variants are ready.
    """
    if interpreting():
        return True
    if torch.cuda.is_current_stream_capturing():
        return False
    layout = (query.device.index, query.dtype, tuple(query.shape[1:]), query.stride(), tuple(k_cache.shape),
              k_cache.dtype, k_cache.stride(), v_cache.stride(), slot_table.stride(), tuple(output.shape[1:]),
              output.stride(), scale_args(kv_scales, k_cache)[2])
    if layout not in _precompiled_layouts:
        start = time.perf_counter()
        count = compile_attention_variants(query, k_cache, v_cache, slot_table, query_start_loc, seq_lens,
                                           output, kv_scales)
        _precompiled_layouts.add(layout)
        logger.info("Proxima: %d attention kernel variants compiled or loaded in %.1f s", count,
                    time.perf_counter() - start)
    return True
