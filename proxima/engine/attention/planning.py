"""Launch planning for the Triton slot-attention kernels, from host-known numbers only.

Layer: pure functions between the launcher (``triton_attention.slot_attention_triton``) and the
GPU's shape. Nothing here reads device memory (no sync), so every choice is also valid inside a
CUDA-graph capture; no choice changes a result, only speed (the kernels are correct for any tile
shape and any split count >= 1). Each is cached: it is asked per layer per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, lru_cache

import torch
import triton
from torch import Tensor

# Shared memory the pipelined K/V tiles of one program may take, by `choose_tiles`' estimate
# (stages x K and V x KV tile x padded head x itemsize). Hopper has 228 KiB per SM: 64-row tiles
# leave headroom for their Q tile and the compiler's own buffers. The 16-row decode shape
# (128-token tiles, 3 stages) compiled and ran at head 128, 192 KiB by the estimate
# (scripts/gpu/sweep_decode.py), and there the estimate overstates: gathered loads are not
# staged that way.
KV_STAGE_BUDGET_BYTES = 160 * 1024
DECODE_KV_STAGE_BUDGET_BYTES = 192 * 1024


def head_size_pad(head_size: int) -> int:
    # A power of two for tl.arange, and at least tl.dot's 16.
    return max(16, triton.next_power_of_2(head_size))


def grid_tiles(num_tokens: int, num_requests: int, block_q: int) -> int:
    # Request r's tiles start at query_start_loc[r] // block_q + r, and every tile index is below
    # query_start_loc[R] // block_q + R <= T // block_q + R: an upper bound from shapes alone.
    return num_tokens // block_q + num_requests


@dataclass(frozen=True, slots=True)
class TileConfig:
    """Launch shape of ``_slot_attention_kernel``.

    A mixed launch (``short_block_m`` > 0) gives each request whose queries fit one tile of
    ``short_block_m`` rows (decodes, speculative decodes) that smaller tile and its own KV tile
    width, in the same launch as the ``block_m`` tiles of the longer queries: which shape a
    program takes is read from the request's query length on the GPU, so the plan suits any batch
    a CUDA graph replays. Warps and pipeline stages are per launch, shared by both shapes.
    """

    block_m: int  # rows per program: BLOCK_Q query tokens x the GQA group of one KV head (>= 16)
    block_n: int  # KV token positions per tile (>= 16: tl.dot's minimum)
    num_warps: int = 4
    num_stages: int = 3
    short_block_m: int = 0  # 0: one shape for every request
    short_block_n: int = 0
    # The long tiles read a request's K/V through TMA descriptors wherever its slots are one
    # ascending run (checked on the GPU, per program; the gather elsewhere). Not chosen by the
    # planner yet: built and tested, its H200 timing is still to be taken (docs/benchmarks.md).
    dense_kv: bool = False
    # A mixed plan's short requests in a launch of their own (its warps and stages; its tiles
    # must be the short shape): one program per request, no search for it, and registers and
    # warps of its own, where one launch compiles both shapes into one kernel at the larger
    # shape's registers. The long launch's programs of short requests return at once. None: one
    # launch.
    short_launch: TileConfig | None = None

    def __post_init__(self) -> None:
        s = self.short_launch
        if s is not None and (s.block_m, s.block_n) != (self.short_block_m, self.short_block_n):
            raise ValueError(f"TileConfig: short_launch tiles {s.block_m}x{s.block_n} must be the short "
                             f"shape {self.short_block_m}x{self.short_block_n}")


@lru_cache(maxsize=4096)  # pure, and asked per layer per step
def choose_tiles(group: int, head_size_pad: int, itemsize: int, max_query_len: int | None) -> TileConfig:
    """Tile shape from shapes and host-side hints alone (no device reads). Any choice is correct.

    ``max_query_len`` None means unknown (a CUDA graph being captured replays other batches):
    the plan is then a mixed one, as for any batch with queries longer than one token.

    Measured on an H200 (bf16, Hq=32, Hkv=8, D=128): 64x64 tiles ran a 4096-token prefill 3.3x
    and a decode+prefill mix 2.1x faster than 16x32; on decode-only batches 16-row tiles were
    ~12% faster than 64-row ones (a decode fills only GROUP rows, the rest is wasted MMA work).
    Decode KV tiles: scripts/gpu/sweep_decode.py replayed 15 shapes x 10 split counts from CUDA
    graphs at 9 batch x context points; 128-token tiles with 4 warps and 3 stages (168
    registers, no spills) were the fastest shape or within 6% of it at every point, where the
    64-token tiles ran up to 1.28x slower (32 x 8,192: 325 against 254-272 us; FA3 259).
    Mixed batches give their decodes that decode shape in the same launch: with one 64-row shape
    for all, 46 decodes + a 150-token prefill ran 1.69x FA3 on the H200 (scripts/gpu/run.sh mixed).
    """
    if itemsize >= 4:
        # fp32 storage (tests, debugging; not a serving dtype): 3xTF32 dots spill registers on
        # bigger tiles; 16x32 was fastest on the H200 for both decode and prefill at D=128/256.
        return TileConfig(block_m=max(16, triton.next_power_of_2(group)), block_n=32, num_stages=2)
    decode_m = max(16, triton.next_power_of_2(group))
    if decode_m == 16:  # the sweep's shape (docstring), for GQA groups up to 16
        decode = _fit_shared_memory(16, 128, head_size_pad, itemsize, DECODE_KV_STAGE_BUDGET_BYTES)
    else:
        decode = _fit_shared_memory(decode_m, 64, head_size_pad, itemsize, KV_STAGE_BUDGET_BYTES)
    if max_query_len is not None and max_query_len <= 1:
        return decode
    # 2 stages won on one H200 and lost on two others (docs/benchmarks.md, prefill tile shape).
    prefill = _fit_shared_memory(max(64, triton.next_power_of_2(group)), 64, head_size_pad, itemsize,
                                 KV_STAGE_BUDGET_BYTES)
    return TileConfig(block_m=prefill.block_m, block_n=prefill.block_n,
                      num_stages=min(prefill.num_stages, decode.num_stages),
                      short_block_m=decode.block_m, short_block_n=decode.block_n)


def cache_tiles(group: int, head_size_pad: int, itemsize: int, max_query_len: int | None,
                int4_codes: bool) -> TileConfig:
    """``choose_tiles``' pick for a cache: int4 codes (unpacked in registers) take their own KV
    tiles (``_pth_tiles``). One place for the launch and the warm-up, so the warm-up compiles the
    variants launches use."""
    # int4 plans ignore the query-length hint: decode-only batches take the mixed plan's decode
    # tiles too. On the H100 (scripts/gpu/run.sh sweep-pth, 8 decode points) the decode plan's
    # 8-warp programs, one an SM, took 1.1-1.4x the time of the mixed plan's 4-warp ones, two an SM
    # (equal at 1 x 2,048).
    tiles = choose_tiles(group, head_size_pad, itemsize, None if int4_codes else max_query_len)
    if int4_codes:
        # On the H200 (scripts/gpu/sweep_pth_decode.py; 20 shapes at 128 x 4096, 32 x 8192, 8 x 32768)
        # one stage with 128-token tiles was fastest at every point, 0.68-0.69x the time of the
        # 64-token 3-stage tiles the bf16 plan gives. int8 codes keep the bf16 plan: with these tiles
        # they took 1.6-1.75x stock int8's time (docs/results/h200-2026-12-03b/decode), against
        # 0.96-1.10x with the bf16 plan's.
        return _pth_tiles(tiles, head_size_pad, itemsize)
    return tiles


def _pth_tiles(tiles: TileConfig, head_size_pad: int, itemsize: int) -> TileConfig:
    """int4 decode tiles: 128 KV tokens, one stage (see choose_launch_shape). The unpacked K and V
    tiles pass through shared memory in the dot dtype: float32 dots at head 256 would need 288 KiB
    of it (the H200 has 227), so wide rows in float32 take 64-token tiles."""
    block_n = 128 if head_size_pad * itemsize <= 512 else 64
    if tiles.short_block_m:
        # One launch. Two (TileConfig.short_launch) timed on the H100 (scripts/gpu/run.sh sweep-pth,
        # graph-replayed decode): 4 warps for the decodes ran as fast as one launch, 8 warps
        # 1.3-2.7x its time (docs/benchmarks.md, issue 25).
        return TileConfig(tiles.block_m, tiles.block_n, tiles.num_warps, 1, tiles.short_block_m, block_n)
    # Decode-only plans run the transposed dots (triton_int4._attend_int4_tiles_swapped): their
    # 128-token first operands take 255 registers and spill with 4 warps (sm_90 build), 172 with 8.
    return TileConfig(tiles.block_m, block_n, 8 if block_n == 128 else tiles.num_warps, 1)


def _fit_shared_memory(
    block_m: int, block_n: int, head_size_pad: int, itemsize: int, budget: int
) -> TileConfig:
    """Wide heads: drop a pipeline stage, then halve the KV tile, until the staged K/V tiles fit."""
    num_stages = 3

    def stage_bytes() -> int:
        return num_stages * 2 * block_n * head_size_pad * itemsize

    if stage_bytes() > budget:
        num_stages = 2
    while stage_bytes() > budget and block_n > 16:
        block_n //= 2
    return TileConfig(block_m=block_m, block_n=block_n, num_stages=num_stages)


# Split-KV launch model, after FlashAttention-2's num_splits_heuristic (its two programs per SM
# and 85% efficiency slack). Not tuned further: on the H200 (scripts/gpu/sweep_decode.py, the
# 128-token decode tiles) its picks ran within 5% of the best split count at every batch x
# context point measured but 1 x 2,048 (15.0 against 13.8 us). The caps (4 waves, 64 splits)
# are ours: past a few waves more splits only add partials to write and merge.
_PROGRAMS_PER_SM = 2
_MAX_SPLIT_WAVES = 4
MAX_SPLITS = 64
_SPLIT_EFFICIENCY_SLACK = 0.85
# vLLM's profiling run never reaches attention, so this temporary is not in its memory budget:
# keep it small (decode batches that split need well under 1 MiB; this bites only on odd shapes).
SPLIT_WORKSPACE_BUDGET_BYTES = 16 << 20


@lru_cache(maxsize=1024)  # pure, and asked per layer per step: the loop below is ~64 iterations
def choose_num_splits(num_programs: int, num_kv_tiles: int, num_sms: int | None) -> int:
    """KV splits per query tile, from host-known numbers only (the choice is baked into graphs).

    ``num_programs``: query tiles x KV heads of the unsplit grid (an estimate is fine);
    ``num_kv_tiles``: ``BLOCK_N`` tiles of the longest context that may run (the hint, or the
    slot table width when there is none); ``num_sms``: None where there is no GPU (the
    interpreter), which never splits. Any value >= 1 is correct.

    Rule: no split when the grid already fills a wave of ``2 x SMs`` programs; otherwise the
    smallest S whose wave efficiency ``waves / ceil(waves)`` (waves = programs x S / slots) is
    within 15% of the best S up to min(64, KV tiles, 4 waves' worth): the fewest splits that
    leave no mostly idle last wave. H200 (132 SMs, Hkv=8, decode, 128-token tiles): batch 1
    -> 14 splits at 2k context, 29 at 32k; batch 8 -> 4; batch >= 32 -> 1.
    """
    if num_sms is None or num_kv_tiles < 2:
        return 1
    slots = _PROGRAMS_PER_SM * num_sms
    if num_programs >= slots:
        return 1
    max_splits = min(MAX_SPLITS, num_kv_tiles, max(1, _MAX_SPLIT_WAVES * slots // max(1, num_programs)))
    efficiency = []
    for splits in range(1, max_splits + 1):
        waves = num_programs * splits / slots
        efficiency.append(waves / math.ceil(waves))
    floor = _SPLIT_EFFICIENCY_SLACK * max(efficiency)
    return next(i + 1 for i, e in enumerate(efficiency) if e >= floor)


def longest_context(slot_table: Tensor, max_seq_len: int | None) -> int:
    """Longest context a launch may see, from the host: the hint, else the slot table width.

    The width bounds every seq_len, so it is the safe basis for the split count when there is no
    hint, as during a graph capture (the caller drops its hints there: see ``capturing``).
    """
    width = slot_table.shape[1]
    if max_seq_len is None:
        return width
    return max(1, min(int(max_seq_len), width))


def capturing(t: Tensor) -> bool:
    """A CUDA graph is being captured on ``t``'s stream: host hints then describe only the
    capture's dummy batch, not the batches the graph will replay."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


@cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int | None:
    """SMs of a CUDA device (cached: it is asked per layer per step); None elsewhere."""
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def choose_launch_shape(
    query: Tensor, k_cache: Tensor, slot_table: Tensor, query_start_loc: Tensor,
    max_query_len: int | None, max_seq_len: int | None, tiles: TileConfig | None = None,
    graph_max_query_len: int | None = None,
) -> tuple[TileConfig, int]:
    """Tile shape and split-KV count of a `slot_attention_triton` call with these arguments.

    ``tiles`` forces the shape (the GPU sweeps time shapes the planner would not pick), leaving the
    split count to the planner. ``graph_max_query_len``: see `slot_attention_triton`."""
    num_tokens, num_query_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[1]
    num_requests = query_start_loc.shape[0] - 1
    group = num_query_heads // num_kv_heads
    if capturing(slot_table):
        # A graph captured now replays other batches: the hints describe only the capture's dummy
        # one: the table width bounds its context, and its query lengths are unknown (mixed plan)
        # unless the caller knows every batch the graph replays (vLLM's uniform-decode graphs).
        max_query_len, max_seq_len = graph_max_query_len, None
    if tiles is None:
        tiles = cache_tiles(group, head_size_pad(head_size), query.dtype.itemsize, max_query_len,
                            k_cache.dtype == torch.uint8)
    # Real tiles number at most T (each holds a token): the tighter estimate for a decode batch.
    num_tiles = grid_tiles(num_tokens, num_requests, tiles.block_m // group)
    # Small grids, the ones that split, are decode batches: in a mixed plan their KV tiles are the
    # short shape's.
    kv_tile = tiles.short_block_n or tiles.block_n
    num_splits = choose_num_splits(min(num_tiles, num_tokens) * num_kv_heads,
                                   triton.cdiv(longest_context(slot_table, max_seq_len), kv_tile),
                                   num_sms(query.device))
    if not (isinstance(num_splits, int) and num_splits >= 1):
        raise ValueError(
            f"slot_attention_triton: choose_num_splits gave {num_splits!r}; it must be an int >= 1"
        )
    bytes_per_split = num_tokens * num_query_heads * (head_size + 2) * 4
    return tiles, min(num_splits, max(1, SPLIT_WORKSPACE_BUDGET_BYTES // bytes_per_split))
