"""int4 per-token-head decode attention in Gluon: warps that never wait for each other.

Why a kernel of its own: ``triton_int4``'s decode tiles run 17 CTA barriers a 128-token tile on
sm_90 (``scripts/kernel_resources.py --loop-ops``): Triton stages the unpacked codes and P in
shared memory for its dots and reduces the softmax across warps, so each program's 4 warps wait on
each other every tile, and two programs an SM do not hide it (docs/benchmarks.md, issue 25). Here
Gluon's explicit layouts put every operand where ``mma.sync`` (``mma_v2``) reads it, in registers:

- each warp owns its own tokens (the tile is ``[W, ...]``, one slice a warp: a batched dot) and its
  own online softmax, so the loop has no barrier and no shared memory; the warps' partials are
  combined once, after the loop;
- the codes are loaded straight into the registers that hold the dots' operands: in the scores'
  dot (S = Q K^T, 16 rows) a 32-bit register pairs two head positions of one token, and the head
  dimension is put in an order (``_k_order``, applied once to the rotated queries) where a
  thread's positions are one 16-byte run of its token's record; the output's dot is transposed
  (acc^T += V^T P^T, ``ROWS_OUT`` = 8 rows on its narrow side): a register pairs two tokens at one
  position (``prmt`` picks the two bytes), P^T of S's first 8 rows is already where that dot's
  second operand is, and the output's positions come out in an order (``_from_v_order``) undone
  once at the end;
- a code c enters its dot as bf16 ``128 + c`` (or fp16 ``1024 + c``): OR-ed into the bias's
  mantissa, no conversion; the bias joins the zero point, as in ``triton_int4``.

Same contract as ``_slot_attention_kernel`` with ``ROLE`` 1 (the short launch of a mixed plan,
``TileConfig.short_launch``): one program a (request, KV head, split); requests of more than
``ROWS_OUT`` rows (``q_len * GROUP > 8``) are left to the unified kernel's long launch
(``triton_attention._launch_plan``). Head size 64 or 128, bf16 or fp16 queries. Runs only compiled
(Gluon has no interpreter): CI checks that it builds for sm_90 and what it issues
(``scripts/kernel_resources.py``); the GPU tests check its output.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from proxima.engine.attention import launch_args
from proxima.engine.attention.gluon_int4_regs import (
    _first_rows,
    _from_v_order,
    _fwht,
    _k_order,
    _v_operand,
    layouts,
)
from proxima.engine.attention.gluon_int4_tile import (
    _p_operand,
    _scores,
    _tile_codes,
    _tile_slots,
    _weighted,
)
from proxima.engine.attention.kernel_launch import CompiledLaunch, tensor_key

_LOG2_E = 1.4426950408889634
ROWS_OUT = 8  # query rows (queries x GQA group) a program attends: the output dot's N


@gluon.jit(do_not_specialize=("num_actual_tokens", "num_splits", "stride_ml_t", "stride_ml_h"))
def _int4_decode_kernel(
    q_ptr, kv_ptr, out_ptr, slot_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    acc_ws_ptr, m_ws_ptr, l_ws_ptr, signs_ptr,
    qk_scale, num_actual_tokens, num_splits,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_slot, stride_table_r,
    stride_acc_t, stride_acc_h, stride_acc_s, stride_ml_t, stride_ml_h,
    HEAD_SIZE: gl.constexpr, GROUP: gl.constexpr, SPLIT: gl.constexpr, DOT_DTYPE: gl.constexpr,
    WIDE_OFFSETS: gl.constexpr, PREFETCH: gl.constexpr, STEP: gl.constexpr,
    MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, K_WORDS: gl.constexpr, V_WORDS: gl.constexpr,
    Q_EARLY: gl.constexpr, Q_LATE: gl.constexpr, O_EARLY: gl.constexpr, O_LATE: gl.constexpr,
):
    """One (request, KV head, split): ``_slot_attention_kernel``'s ROLE 1 for int4 caches.

    ``kv_ptr``: the layer's slot records as int32 words (``PTHCache.k_words``' storage, slot 0's
    first record), ``stride_slot`` words a slot; scales are float32 words whose 4 low mantissa
    bits hold the zero point. Base-2
    logits (``qk_scale`` has log2(e) and 1/D in it, the rotated space's dot products being D
    times larger)."""
    W: gl.constexpr = MMA.warps_per_cta[0]
    R: gl.constexpr = 16  # the scores' rows (mma_v2's M)
    RO: gl.constexpr = 8  # the rows attended: the output dot's N
    TN: gl.constexpr = 16
    D: gl.constexpr = HEAD_SIZE
    if DOT_DTYPE == gl.bfloat16:
        BIAS: gl.constexpr = 0x43004300
        CODE_BIAS: gl.constexpr = 128
    else:
        BIAS: gl.constexpr = 0x64006400
        CODE_BIAS: gl.constexpr = 1024
    req = gl.program_id(0)
    kv_head = gl.program_id(1)
    q_start = gl.load(query_start_loc_ptr + req)
    q_len = gl.load(query_start_loc_ptr + req + 1) - q_start
    if (q_len == 0) | (q_len * GROUP > RO):
        return
    seq_len = gl.load(seq_lens_ptr + req)
    context = seq_len - q_len
    slot_row_ptr = slot_table_ptr + req.to(gl.int64) * stride_table_r

    # Queries: the RO rows a program attends, rotated (signs, then Walsh-Hadamard in float32) and
    # rounded to the model dtype as vLLM rounds them, a copy a warp ([W * RO, D], a quarter row a
    # thread: rotation_layouts); then R rows (zeros past RO) in _k_order for the scores' dot.
    row_q = gl.arange(0, W * RO, layout=gl.SliceLayout(1, Q_EARLY)) % RO
    d_q = gl.arange(0, D, layout=gl.SliceLayout(0, Q_EARLY))
    tok_q = (q_start + row_q // GROUP).to(gl.int64)
    ok_q = (row_q < q_len * GROUP) & (tok_q < num_actual_tokens)
    head_q = kv_head * GROUP + row_q % GROUP
    q_off = gl.expand_dims(tok_q * stride_q_t + head_q * stride_q_h, 1) + gl.expand_dims(d_q, 0)
    q = gl.load(q_ptr + q_off, mask=gl.expand_dims(ok_q, 1), other=0.0).to(gl.float32)
    signs = gl.load(signs_ptr + d_q)
    LOG2_D: gl.constexpr = D.bit_length() - 1
    q = _fwht(q * gl.expand_dims(signs, 0), LOG2_D, Q_LATE)
    q = gl.reshape(q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE), [W, RO, D])
    q = gl.reshape(gl.permute(gl.join(q, gl.zeros_like(q)), [0, 3, 1, 2]), [W, R, D])
    q_sum = gl.convert_layout(gl.sum(q.to(gl.float32), 2), gl.SliceLayout(2, MMA))  # [W, R]
    q_op = gl.convert_layout(_k_order(q), A_OP)

    L_ROW: gl.constexpr = gl.SliceLayout(2, MMA)  # [W, R]
    L_TOK: gl.constexpr = gl.SliceLayout(1, MMA)  # [W, TN]
    rows = gl.expand_dims(gl.arange(0, W, layout=gl.SliceLayout(1, L_ROW)) * 0, 1) \
        + gl.expand_dims(gl.arange(0, R, layout=gl.SliceLayout(0, L_ROW)), 0)
    q_abs_pos = context + rows // GROUP

    num_kv_tiles = gl.cdiv(seq_len, W * TN)
    if SPLIT:
        split = gl.program_id(2)
        tile_start = split * num_kv_tiles // num_splits
        tile_end = (split + 1) * num_kv_tiles // num_splits
    else:
        tile_start = 0
        tile_end = num_kv_tiles

    # A record is 2 (D/8 + 1) words: a constant stride, so the compiler sees K's 8-byte alignment.
    head_ptr = kv_ptr + kv_head * (D // 4 + 2)
    L_KS: gl.constexpr = gl.SliceLayout(1, K_WORDS)

    # acc^T [W, D, RO]: the output's positions on the dot's long side, its RO = 8 rows on the narrow.
    acc = gl.zeros([W, D, RO], gl.float32, MMA)
    L_ACC_ROW: gl.constexpr = gl.SliceLayout(1, MMA)  # [W, RO], acc^T's columns
    m_i = gl.full([W, R], float("-inf"), gl.float32, L_ROW)
    p_sums = gl.zeros([W, R, TN], gl.float32, MMA)
    z_sums = gl.zeros([W, R, TN], gl.float32, MMA)

    # A software pipeline in registers: each tile issues the code loads of the tile PREFETCH ahead
    # and the slots of the one after that before its own arithmetic (PREFETCH 0: its own codes).
    # V's words and both scales are read at the same tokens a thread (2t, 2t + 1, 2t + 8, 2t + 9):
    # one slot load serves them (L_VS and L_TOK are one layout).
    sk, ok_k = _tile_slots(tile_start, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                           WIDE_OFFSETS)
    ss, ok_s = _tile_slots(tile_start, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                           WIDE_OFFSETS)
    if STEP == 2:  # the step's second tile (PREFETCH 0 only)
        sk2, ok_k2 = _tile_slots(tile_start + 1, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                                 WIDE_OFFSETS)
        ss2, ok_s2 = _tile_slots(tile_start + 1, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                                 WIDE_OFFSETS)
    if PREFETCH > 0:
        k_words, v_words, k_bits, v_bits = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot, D,
                                                       K_WORDS, V_WORDS)
        if PREFETCH == 2:
            sk, ok_k = _tile_slots(tile_start + 1, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                                   WIDE_OFFSETS)
            ss, ok_s = _tile_slots(tile_start + 1, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                                   WIDE_OFFSETS)
            k_next, v_next, kb_next, vb_next = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot, D,
                                                           K_WORDS, V_WORDS)
        else:  # placeholders, never read
            k_next, v_next, kb_next, vb_next = k_words, v_words, k_bits, v_bits
        sk, ok_k = _tile_slots(tile_start + PREFETCH, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                               WIDE_OFFSETS)
        ss, ok_s = _tile_slots(tile_start + PREFETCH, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                               WIDE_OFFSETS)
    for tile in range(tile_start, tile_end, STEP):
        if PREFETCH == 0:  # the tile's own codes, its slots loaded a tile ahead
            k_cur, v_cur, kb_cur, vb_cur = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot, D,
                                                       K_WORDS, V_WORDS)
            if STEP == 2:  # and the next tile's, in flight together; its slots a step ahead too
                k_two, v_two, kb_two, vb_two = _tile_codes(sk2, ok_k2, ss2, ok_s2, head_ptr, stride_slot,
                                                           D, K_WORDS, V_WORDS)
                sk2, ok_k2 = _tile_slots(tile + 3, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                                         WIDE_OFFSETS)
                ss2, ok_s2 = _tile_slots(tile + 3, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                                         WIDE_OFFSETS)
        else:
            k_cur = k_words
            v_cur = v_words
            kb_cur = k_bits
            vb_cur = v_bits
            if PREFETCH == 2:
                k_words, v_words, k_bits, v_bits = k_next, v_next, kb_next, vb_next
                k_next, v_next, kb_next, vb_next = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot,
                                                               D, K_WORDS, V_WORDS)
            else:
                k_words, v_words, k_bits, v_bits = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot,
                                                               D, K_WORDS, V_WORDS)
        sk, ok_k = _tile_slots(tile + PREFETCH + STEP, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                               WIDE_OFFSETS)
        ss, ok_s = _tile_slots(tile + PREFETCH + STEP, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                               WIDE_OFFSETS)

        s = _scores(q_op, q_sum, k_cur, kb_cur, tile, tile_end, seq_len, q_abs_pos, qk_scale, DOT_DTYPE, BIAS,
                    CODE_BIAS, W, R, TN, MMA, B_OP, L_TOK)
        m_new = gl.maximum(m_i, gl.max(s, 2))
        if STEP == 2:  # one softmax update for both tiles: half the rescales and row reductions
            s_two = _scores(q_op, q_sum, k_two, kb_two, tile + 1, tile_end, seq_len, q_abs_pos, qk_scale,
                            DOT_DTYPE, BIAS, CODE_BIAS, W, R, TN, MMA, B_OP, L_TOK)
            m_new = gl.maximum(m_new, gl.max(s_two, 2))
        m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)
        p = gl.exp2(s - gl.expand_dims(m_safe, 2))
        alpha = gl.exp2(m_i - m_safe)
        alpha3 = gl.expand_dims(alpha, 2)
        p_sums = p_sums * alpha3 + p
        p_dot, z = _weighted(p, vb_cur, DOT_DTYPE, CODE_BIAS)
        z_sums = z_sums * alpha3 + z
        p_t = _p_operand(p_dot, B_OP)
        # alpha moves to acc^T's columns by shuffles within the warp.
        alpha_t = gl.expand_dims(gl.convert_layout(_first_rows(alpha), L_ACC_ROW), 1)
        acc = mma_v2(_v_operand(v_cur, DOT_DTYPE, BIAS, A_OP), p_t, acc * alpha_t)
        if STEP == 2:
            p = gl.exp2(s_two - gl.expand_dims(m_safe, 2))
            p_dot, z = _weighted(p, vb_two, DOT_DTYPE, CODE_BIAS)
            p_sums = p_sums + p
            z_sums = z_sums + z
            acc = mma_v2(_v_operand(v_two, DOT_DTYPE, BIAS, A_OP), _p_operand(p_dot, B_OP), acc)
        m_i = m_new

    # The warps' partials, combined once: [W, D, RO] -> [RO, D].
    z_w = gl.convert_layout(_first_rows(gl.sum(z_sums, 2)), L_ACC_ROW)
    acc = acc - gl.expand_dims(z_w, 1)
    l_w = _first_rows(gl.sum(p_sums, 2))  # [W, RO]
    m_w = _first_rows(m_i)
    m_all = gl.max(m_w, 0)  # [RO]
    m_all_safe = gl.where(m_all > float("-inf"), m_all, 0.0)
    w_scale = gl.exp2(m_w - gl.expand_dims(m_all_safe, 0))  # [W, RO]
    l_all = gl.sum(l_w * w_scale, 0)
    acc = gl.sum(acc * gl.expand_dims(gl.convert_layout(w_scale, L_ACC_ROW), 1), 0)  # [D, RO]
    ROW2: gl.constexpr = O_LATE
    # The inverse rotation (vLLM's single_rht(x, inverse=True) / D).
    acc = _fwht(gl.convert_layout(_from_v_order(gl.permute(acc, [1, 0])), O_EARLY), LOG2_D, O_LATE)
    d_o = gl.arange(0, D, layout=gl.SliceLayout(0, ROW2))
    signs_o = gl.load(signs_ptr + d_o)
    acc = acc * gl.expand_dims(signs_o / D, 0)

    r_o = gl.arange(0, RO, layout=gl.SliceLayout(1, ROW2))
    tok_o = (q_start + r_o // GROUP).to(gl.int64)
    ok_o = (r_o < q_len * GROUP) & (tok_o < num_actual_tokens)
    head_o = kv_head * GROUP + r_o % GROUP
    m_o = gl.convert_layout(m_all, gl.SliceLayout(1, ROW2))
    l_o = gl.convert_layout(l_all, gl.SliceLayout(1, ROW2))
    if SPLIT:
        ml = tok_o * stride_ml_t + head_o * stride_ml_h + split
        gl.store(m_ws_ptr + ml, m_o, mask=ok_o)
        gl.store(l_ws_ptr + ml, l_o, mask=ok_o)
        if tile_start < tile_end:
            row = tok_o * stride_acc_t + head_o * stride_acc_h + split * stride_acc_s
            gl.store(acc_ws_ptr + gl.expand_dims(row, 1) + gl.expand_dims(d_o, 0), acc,
                     mask=gl.expand_dims(ok_o, 1))
    else:
        out = acc / gl.expand_dims(gl.where(l_o > 0.0, l_o, 1.0), 1)
        o_off = gl.expand_dims(tok_o * stride_o_t + head_o * stride_o_h, 1) + gl.expand_dims(d_o, 0)
        gl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=gl.expand_dims(ok_o, 1))


NUM_WARPS = 4
# KV tiles a warp's loads run ahead of its arithmetic (0, 1 or 2; registers hold them); None: chosen
# per launch (prefetch_for). The benchmarks and tests force one. 0: each tile loads its own codes
# (only its slots a tile ahead): 127 registers unsplit, four programs an SM (sm_90 build), so the
# latency is left to the other warps.
PREFETCH: int | None = None
# KV tiles a softmax update takes: 2 loads both tiles' codes at once (its own loads: PREFETCH 0,
# whatever PREFETCH says) and halves the rescales and row reductions. Not served: on an H100 never
# clearly the best depth, up to 13% slower than the best one (docs/benchmarks.md, 2026-12-07).
TILES_A_STEP = 1
_launch = CompiledLaunch(_int4_decode_kernel)


def launch_options(tiles_a_step: int) -> dict:
    """Compile options: two tiles a step are capped at 168 registers (180 uncapped, two programs
    an SM), three programs an SM; the sm_90 build spills nothing (scripts/kernel_resources.py)."""
    return {"num_warps": NUM_WARPS} | ({"maxnreg": 168} if tiles_a_step == 2 else {})


# A wave's cost, in waves of two-tile programs (two an SM), where every program reads the same
# context. One tile (three an SM), H200: 128 x 4,096 and 128 x 8,192 1.10, 256 x 4,096 1.09,
# 512 x 1,024 1.17. None (four an SM), H100: 1.74-1.92 at 64 x 1k-8k, 128 x 1k-4k, 256 x 4k
# (docs/benchmarks.md, issue 25).
_SHALLOW_WAVE_COST = 1.1
_UNPREFETCHED_WAVE_COST = 1.85
# Per prefetch depth, deepest first (ties go to it): programs an SM at head 128, a wave's cost.
_DEPTHS = {2: (2, 1.0), 1: (3, _SHALLOW_WAVE_COST), 0: (4, _UNPREFETCHED_WAVE_COST)}


def _depths(split: bool) -> tuple[int, ...]:
    """The depths a launch may take: a split one never 0 (its 152 registers fit three an SM, as 1's)."""
    return (2, 1) if split else (2, 1, 0)


def prefetch_for(programs: int, device: torch.device, split: bool = False) -> int:
    """Two tiles of loads in flight (227 registers at head 128: two programs an SM), one (167:
    three an SM) or none (127 unsplit: four an SM; 152 split: three, so never taken split),
    whichever runs a launch's programs in least time: its waves (a partial one counts whole) times
    a wave's cost. Past one wave of two an SM the third program
    mostly wins (H200, graph replay: 46 x 300, 368 programs, 25.0 us against 33.4; 128 x 4,096
    292.9 against 354.7); where both take the same waves, the deeper pipeline does (64 x 4,096, 512
    programs: 182.9 against 187.7). The fourth wins only where it saves a wave of three, at 397-528
    programs (H100: 64 x 1,024, 512 programs, 62.5 us against 71.4; 64 x 4,096 178.1 against
    191.4). Two tiles a step load their own: 0."""
    if TILES_A_STEP == 2:
        return 0
    if PREFETCH is not None:
        return PREFETCH
    sms = _multiprocessors(device)
    cost = {depth: math.ceil(programs / (_DEPTHS[depth][0] * sms)) * _DEPTHS[depth][1]
            for depth in _depths(split)}
    return min(cost, key=cost.get)  # ties: the deeper pipeline (listed first)


def prefetch_choices(split: bool = False) -> tuple[int, ...]:
    """The prefetch depths launches may take, split or not (the warm-up compiles each)."""
    if TILES_A_STEP == 2:
        return (0,)
    if PREFETCH is not None:
        return (PREFETCH,)
    return tuple(sorted(_depths(split)))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # the emulation on CPU (tests/gluon_emulator.py): an H100's or H200's count
    return torch.cuda.get_device_properties(device).multi_processor_count


def serves(query: Tensor, group: int) -> bool:
    """Whether this kernel can take a launch's short requests: bf16/fp16 queries, head 64 or 128,
    a GQA group of at most ``ROWS_OUT``, an sm_80+ GPU (``mma_v2``), and ``launch_args.INT4_DECODE``
    says so (the benchmarks' switch)."""
    return (launch_args.INT4_DECODE == "gluon" and query.dtype in (torch.bfloat16, torch.float16)
            and query.shape[-1] in (64, 128) and group <= ROWS_OUT and runs_on(query.device))


def runs_on(device: torch.device) -> bool:
    """An sm_80+ GPU: ``mma_v2``'s (the CPU tests replace this to run the kernel's source in torch:
    tests/gluon_emulator.py)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


@functools.cache
def _layouts(num_warps: int, head_size: int) -> tuple:
    return tuple(layouts(num_warps, head_size).values())


def decode_launch(query: Tensor, cache, slot_table: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                  scale: float, output: Tensor, row_limit: int, num_splits: int, signs: Tensor,
                  workspace: tuple[Tensor, Tensor, Tensor] | None, ws_strides: tuple[int, ...]) -> tuple:
    """The launch of ``_int4_decode_kernel`` over every request of a call (grid: requests x KV heads
    x splits), as an entry of ``triton_attention._launch_plan``: (launcher, grid, args, key, options).
    ``workspace`` when ``num_splits`` > 1 (merged by the plan's merge launch). Requests with more
    than ``ROWS_OUT`` rows are left to the plan's other launch."""
    num_requests = query_start_loc.shape[0] - 1
    num_kv_heads = cache.k_words.shape[1]
    head_size = query.shape[-1]
    group = query.shape[1] // num_kv_heads
    acc_ws, m_ws, l_ws = workspace if num_splits > 1 else (output,) * 3
    k = cache.k_words
    record = head_size // 4 + 2  # words: K codes, K scale, V codes, V scale
    offsets = tuple(t.storage_offset() - k.storage_offset()
                    for t in (cache.v_words, cache.k_scales, cache.v_scales))
    if (k.stride(1), *offsets) != (record, record // 2, record // 2 - 1, record - 1):
        raise ValueError("int4 decode: the cache views are not per_token_head.cache_views' records")
    dot = gl.bfloat16 if query.dtype == torch.bfloat16 else gl.float16
    # Offsets in 32-bit words: a layer's cache under 2^31 of them takes 32-bit arithmetic.
    wide = k.shape[0] * k.stride(0) + k.storage_offset() >= 2**31 - 2**20
    tensors = (query, k, output, slot_table, query_start_loc, seq_lens, acc_ws, m_ws, l_ws, signs)
    strides = (query.stride(0), query.stride(1), output.stride(0), output.stride(1), k.stride(0),
               slot_table.stride(0), *ws_strides)
    constexprs = (head_size, group, num_splits > 1, dot, wide,
                  prefetch_for(num_requests * num_kv_heads * num_splits, query.device, num_splits > 1),
                  TILES_A_STEP)
    args = (*tensors, float(scale) / head_size * _LOG2_E, row_limit, num_splits, *strides, *constexprs,
            *_layouts(NUM_WARPS, head_size))
    key = (query.device.index, tensor_key(tensors), strides[:-2], constexprs, NUM_WARPS)
    return _launch, (num_requests, num_kv_heads, num_splits), args, key, launch_options(TILES_A_STEP)
