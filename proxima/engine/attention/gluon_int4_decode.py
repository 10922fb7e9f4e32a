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

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from proxima.engine.attention import launch_args
from proxima.engine.attention.kernel_launch import CompiledLaunch, tensor_key

_LOG2_E = 1.4426950408889634
ROWS_OUT = 8  # query rows (queries x GQA group) a program attends: the output dot's N
WARP_TOKENS = 16  # tokens a warp takes a tile: two of mma_v2's N for K, one K step for V


def _bits(n: int) -> int:
    return n.bit_length() - 1


def layouts(num_warps: int, head_size: int) -> dict:
    """The kernel's layouts (constexpr arguments), for ``num_warps`` warps and this head size."""
    w, d, tn = num_warps, head_size, WARP_TOKENS
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[w, 1, 1], instr_shape=[1, 16, 8])
    warp_bases = [[1 << i, 0, 0] for i in range(_bits(w))]
    k_words_per_thread = d // 32  # a thread's 32 positions of its token in K's dot
    v_words_per_thread = d // 64  # a thread's 16 positions of each of its 4 tokens in V's dot
    # K words [W, D/8, TN]: lane t (lane % 4) holds words t * (D/32) + i, lane g (lane / 4) token g
    # (and g + 8, a register).
    k_words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1 << i, 0] for i in range(_bits(k_words_per_thread))] + [[0, 0, 8]],
        lane_bases=[[0, k_words_per_thread, 0], [0, 2 * k_words_per_thread, 0],
                    [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=warp_bases, block_bases=[], shape=[w, d // 8, tn])
    # V words [W, TN, D/8]: lane t holds tokens 2t, 2t + 1, 2t + 8, 2t + 9; lane g words g * (D/64) + i.
    v_words = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1 << i] for i in range(_bits(v_words_per_thread))] + [[0, 1, 0], [0, 8, 0]],
        lane_bases=[[0, 2, 0], [0, 4, 0], [0, 0, v_words_per_thread], [0, 0, 2 * v_words_per_thread],
                    [0, 0, 4 * v_words_per_thread]],
        warp_bases=warp_bases, block_bases=[], shape=[w, tn, d // 8])
    return dict(
        MMA=mma,
        A_OP=gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2),
        B_OP=gl.DotOperandLayout(operand_index=1, parent=mma, k_width=2),
        K_WORDS=k_words,
        V_WORDS=v_words,
        # Rows of the head dimension whole in a thread: the rotations' butterflies stay in registers.
        ROW_MAJOR=gl.BlockedLayout([1, 1, d], [1, 32, 1], [w, 1, 1], [2, 1, 0]),
        ROWS_2D=gl.BlockedLayout([1, d], [8, 4], [w, 1], [1, 0]),
    )


# (x & 0x000F000F) | bias in one lop3 (truth table (a & b) | c over operand bytes 0xF0, 0xCC, 0xAA).
@gluon.jit
def _mask_or_bias(x, BIAS: gl.constexpr):
    return gl.inline_asm_elementwise("lop3.b32 $0, $1, 0x000F000F, $2, 0xEA;", "=r,r,n", [x, BIAS],
                                     dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _token_pair(a, b, BYTE: gl.constexpr, BIAS: gl.constexpr):
    """Byte BYTE's low nibble of a and of b as one register: a's in the low half, b's in the high."""
    SEL: gl.constexpr = BYTE | (BYTE << 4) | ((4 + BYTE) << 8) | ((4 + BYTE) << 12)
    return gl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3; lop3.b32 $0, $0, 0x000F000F, $4, 0xEA;",
                                     "=r,r,r,n,n", [a, b, SEL, BIAS], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _halves(pairs, DOT_DTYPE: gl.constexpr):
    """[..., N, M] int32 registers of two 16-bit values -> [..., 2N, M] DOT_DTYPE (low half first)."""
    lo = pairs.to(gl.int16)
    hi = (pairs >> 16).to(gl.int16)
    x = gl.join(lo, hi)  # [..., N, M, 2]
    W: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    M: gl.constexpr = x.shape[2]
    x = gl.permute(x, [0, 1, 3, 2])
    return gl.reshape(x, [W, 2 * N, M]).to(DOT_DTYPE, bitcast=True)


@gluon.jit
def _k_operand(words, DOT_DTYPE: gl.constexpr, BIAS: gl.constexpr, B_OP: gl.constexpr):
    """K words [W, D/8, TN] (``K_WORDS``) -> the scores dot's second operand [W, D, TN], positions
    in ``_k_order``: word w's nibbles j and j + 4 are one register (a shift and a lop3)."""
    W: gl.constexpr = words.shape[0]
    NW: gl.constexpr = words.shape[1]
    TN: gl.constexpr = words.shape[2]
    DW: gl.constexpr = NW // 4
    p0 = _mask_or_bias(words, BIAS)
    p1 = _mask_or_bias(words >> 4, BIAS)
    p2 = _mask_or_bias(words >> 8, BIAS)
    p3 = _mask_or_bias(words >> 12, BIAS)
    x = gl.join(gl.join(p0, p1), gl.join(p2, p3))  # [W, NW, TN, 2(h), 2(c0)]: pair j = 2 c0 + h
    x = gl.reshape(x, [W, 4, DW, TN, 2, 2])  # word = DW t + c_hi
    x = gl.permute(x, [0, 2, 5, 4, 1, 3])  # [W, c_hi, c0, h, t, TN]
    x = gl.reshape(x, [W, NW * 4, TN])
    return gl.convert_layout(_halves(x, DOT_DTYPE), B_OP)


@gluon.jit
def _v_operand(words, DOT_DTYPE: gl.constexpr, BIAS: gl.constexpr, A_OP: gl.constexpr):
    """V words [W, TN, D/8] (``V_WORDS``) -> the output dot's first operand V^T [W, D, TN], positions
    in the order ``_from_v_order`` undoes: tokens 2i and 2i + 1 at one position are one register (a
    prmt and a lop3)."""
    W: gl.constexpr = words.shape[0]
    TN: gl.constexpr = words.shape[1]
    NW: gl.constexpr = words.shape[2]
    VW: gl.constexpr = NW // 8
    x = gl.permute(gl.reshape(words, [W, TN // 2, 2, NW]), [0, 1, 3, 2])
    a, b = gl.split(x)  # [W, TN/2, NW]: tokens 2i, 2i + 1
    a4 = a >> 4
    b4 = b >> 4
    x = gl.join(
        gl.join(gl.join(_token_pair(a, b, 0, BIAS), _token_pair(a4, b4, 0, BIAS)),
                gl.join(_token_pair(a, b, 1, BIAS), _token_pair(a4, b4, 1, BIAS))),
        gl.join(gl.join(_token_pair(a, b, 2, BIAS), _token_pair(a4, b4, 2, BIAS)),
                gl.join(_token_pair(a, b, 3, BIAS), _token_pair(a4, b4, 3, BIAS))),
    )  # [W, TN/2, NW, 2(x0), 2(x1), 2(x2)]: position 8 word + x
    if VW == 2:
        x = gl.reshape(x, [W, TN // 2, 8, 2, 2, 2, 2])  # word = 2 g + u
        x = gl.permute(x, [0, 1, 6, 5, 4, 3, 2])  # [W, TN/2, x2, x1, x0, u, g]
    else:
        x = gl.permute(x, [0, 1, 5, 4, 3, 2])  # [W, TN/2, x2, x1, x0, g]
    x = gl.reshape(x, [W, TN // 2, NW * 8])
    lo = x.to(gl.int16)
    hi = (x >> 16).to(gl.int16)
    x = gl.permute(gl.join(lo, hi), [0, 2, 1, 3])  # [W, D, TN/2, 2]
    x = gl.reshape(x, [W, NW * 8, TN]).to(DOT_DTYPE, bitcast=True)
    return gl.convert_layout(x, A_OP)


@gluon.jit
def _first_rows(x):
    """[W, 16, ...] -> its rows 0-7 [W, 8, ...] (rows r and r + 8 are one thread's registers)."""
    if len(x.shape) == 2:
        W: gl.constexpr = x.shape[0]
        a, b = gl.split(gl.permute(gl.reshape(x, [W, 2, 8]), [0, 2, 1]))
    else:
        W: gl.constexpr = x.shape[0]
        N: gl.constexpr = x.shape[2]
        a, b = gl.split(gl.permute(gl.reshape(x, [W, 2, 8, N]), [0, 2, 3, 1]))
    return a


@gluon.jit
def _k_order(q):
    """[W, R, D] head positions in the natural order -> ``_k_operand``'s: logical k = e + 2t + 8h +
    16 c0 + 32 c_hi holds position 8 (DW t + c_hi) + 4 e + 2 c0 + h."""
    W: gl.constexpr = q.shape[0]
    R: gl.constexpr = q.shape[1]
    D: gl.constexpr = q.shape[2]
    x = gl.reshape(q, [W, R, 4, D // 32, 2, 2, 2])  # [t, c_hi, e, c0, h]
    x = gl.permute(x, [0, 1, 3, 5, 6, 2, 4])  # [c_hi, c0, h, t, e]
    return gl.reshape(x, [W, R, D])


@gluon.jit
def _from_v_order(acc):
    """[R, D] in ``_v_operand``'s order (logical m = g + 8 u + 16 x holds position 16 g + 8 u + x
    at D 128; m = g + 8 x holds 8 g + x at D 64) -> the natural order."""
    R: gl.constexpr = acc.shape[0]
    D: gl.constexpr = acc.shape[1]
    if D == 128:
        x = gl.reshape(acc, [R, 8, 2, 8])  # [x, u, g]
        x = gl.permute(x, [0, 3, 2, 1])  # [g, u, x]
    else:
        x = gl.reshape(acc, [R, 8, 8])  # [x, g]
        x = gl.permute(x, [0, 2, 1])  # [g, x]
    return gl.reshape(x, [R, D])


@gluon.jit
def _butterfly_stage(x, H: gl.constexpr):
    """One Walsh-Hadamard stage over the columns of [M, D]: (2Hj + i, 2Hj + H + i) -> (a + b, a - b),
    in registers (``triton_int4._butterfly_stage``)."""
    M: gl.constexpr = x.shape[0]
    n: gl.constexpr = x.shape[1]
    a, b = gl.split(gl.permute(gl.reshape(x, [M, n // (2 * H), 2, H]), [0, 1, 3, 2]))
    return gl.reshape(gl.permute(gl.join(a + b, a - b), [0, 1, 3, 2]), [M, n])


@gluon.jit
def _fwht(x, LOG2_D: gl.constexpr):
    """``x @ H`` for [M, D] float32 (``triton_int4._fwht``)."""
    for i in gl.static_range(LOG2_D):
        x = _butterfly_stage(x, 1 << i)
    return x


@gluon.jit
def _token_index(tile, W: gl.constexpr, TN: gl.constexpr, LAYOUT: gl.constexpr):
    """[W, TN] positions of a tile in LAYOUT (a [W, TN] slice of a 3-D layout): warp w reads
    positions tile W TN + w TN + i."""
    w = gl.arange(0, W, layout=gl.SliceLayout(1, LAYOUT))
    i = gl.arange(0, TN, layout=gl.SliceLayout(0, LAYOUT))
    return tile * (W * TN) + gl.expand_dims(w, 1) * TN + gl.expand_dims(i, 0)


@gluon.jit
def _tile_slots(tile, tile_end, slot_row_ptr, seq_len, W: gl.constexpr, TN: gl.constexpr,
                LAYOUT: gl.constexpr, WIDE: gl.constexpr):
    """A tile's slots in LAYOUT and which to read: in the sequence, and the tile before tile_end.
    ``WIDE``: offsets into the cache need 64 bits (int32 ones save the 64-bit address arithmetic
    of every load where the layer's cache has under 2^31 words)."""
    pos = _token_index(tile, W, TN, LAYOUT)
    ok = (pos < seq_len) & (tile < tile_end)
    slots = gl.load(slot_row_ptr + pos, mask=ok, other=0)
    if WIDE:
        slots = slots.to(gl.int64)
    return slots, ok


@gluon.jit
def _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot, D: gl.constexpr, K_WORDS: gl.constexpr,
                V_WORDS: gl.constexpr):
    """K words [W, D/8, TN], V words [W, TN, D/8] and both scale words [W, TN] (zero point in the
    low bits); zeros where not ok. ``head_ptr``: the KV head's record in slot 0, as 32-bit words
    ``[K codes (D/8) | K scale | V codes (D/8) | V scale]``."""
    K_SCALE: gl.constexpr = D // 8
    V_CODES: gl.constexpr = D // 8 + 1
    V_SCALE: gl.constexpr = D // 4 + 1
    # A pointer a token first, then constant offsets: one address computation a token, and the
    # words' offsets fold into the loads' immediates.
    kw = gl.arange(0, D // 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, K_WORDS)))
    k_ptrs = gl.expand_dims(head_ptr + sk * stride_slot, 1) + gl.expand_dims(gl.expand_dims(kw, 0), 2)
    k_words = gl.load(k_ptrs, mask=gl.expand_dims(ok_k, 1), other=0)
    token_ptr = head_ptr + ss * stride_slot
    v_token_ptr = gl.convert_layout(token_ptr, gl.SliceLayout(2, V_WORDS), assert_trivial=True)
    ok_v = gl.convert_layout(ok_s, gl.SliceLayout(2, V_WORDS), assert_trivial=True)
    vw = gl.arange(0, D // 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, V_WORDS)))
    v_ptrs = gl.expand_dims(v_token_ptr + V_CODES, 2) + gl.expand_dims(gl.expand_dims(vw, 0), 1)
    v_words = gl.load(v_ptrs, mask=gl.expand_dims(ok_v, 2), other=0)
    k_bits = gl.load(token_ptr + K_SCALE, mask=ok_s, other=0)
    v_bits = gl.load(token_ptr + V_SCALE, mask=ok_s, other=0)
    return k_words, v_words, k_bits, v_bits


@gluon.jit(do_not_specialize=("num_actual_tokens", "num_splits", "stride_ml_t", "stride_ml_h"))
def _int4_decode_kernel(
    q_ptr, kv_ptr, out_ptr, slot_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    acc_ws_ptr, m_ws_ptr, l_ws_ptr, signs_ptr,
    qk_scale, num_actual_tokens, num_splits,
    stride_q_t, stride_q_h, stride_o_t, stride_o_h, stride_slot, stride_table_r,
    stride_acc_t, stride_acc_h, stride_acc_s, stride_ml_t, stride_ml_h,
    HEAD_SIZE: gl.constexpr, GROUP: gl.constexpr, SPLIT: gl.constexpr, DOT_DTYPE: gl.constexpr,
    WIDE_OFFSETS: gl.constexpr, PREFETCH: gl.constexpr,
    MMA: gl.constexpr, A_OP: gl.constexpr, B_OP: gl.constexpr, K_WORDS: gl.constexpr, V_WORDS: gl.constexpr,
    ROW_MAJOR: gl.constexpr, ROWS_2D: gl.constexpr,
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

    # Queries: [W, R, D], every warp the same rows, rotated (signs, then Walsh-Hadamard in float32),
    # rounded to the model dtype as vLLM rounds them, put in _k_order for the scores' dot.
    L_QR: gl.constexpr = gl.SliceLayout(2, ROW_MAJOR)
    r_q = gl.arange(0, R, layout=gl.SliceLayout(0, L_QR))
    d_q = gl.arange(0, D, layout=gl.SliceLayout(0, gl.SliceLayout(1, ROW_MAJOR)))
    w_q = gl.arange(0, W, layout=gl.SliceLayout(1, L_QR))
    row_q = gl.expand_dims(w_q * 0, 1) + gl.expand_dims(r_q, 0)  # [W, R]
    tok_q = (q_start + row_q // GROUP).to(gl.int64)
    ok_q = (row_q < q_len * GROUP) & (tok_q < num_actual_tokens)
    head_q = kv_head * GROUP + row_q % GROUP
    q_off = (gl.expand_dims(tok_q * stride_q_t + head_q * stride_q_h, 2)
             + gl.expand_dims(gl.expand_dims(d_q, 0), 1))
    q = gl.load(q_ptr + q_off, mask=gl.expand_dims(ok_q, 2), other=0.0).to(gl.float32)
    signs = gl.load(signs_ptr + d_q)
    LOG2_D: gl.constexpr = D.bit_length() - 1
    q = gl.reshape(_fwht(gl.reshape(q * gl.expand_dims(gl.expand_dims(signs, 0), 1), [W * R, D]), LOG2_D),
                   [W, R, D])
    q = q.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)
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
    # and the slots of the one after that before its own arithmetic.
    # V's words and both scales are read at the same tokens a thread (2t, 2t + 1, 2t + 8, 2t + 9):
    # one slot load serves them (L_VS and L_TOK are one layout).
    sk, ok_k = _tile_slots(tile_start, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                           WIDE_OFFSETS)
    ss, ok_s = _tile_slots(tile_start, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                           WIDE_OFFSETS)
    k_words, v_words, k_bits, v_bits = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot, D, K_WORDS,
                                                   V_WORDS)
    if PREFETCH == 2:
        sk, ok_k = _tile_slots(tile_start + 1, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                           WIDE_OFFSETS)
        ss, ok_s = _tile_slots(tile_start + 1, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                           WIDE_OFFSETS)
        k_next, v_next, kb_next, vb_next = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot, D, K_WORDS,
                                                       V_WORDS)
    else:  # placeholders, never read
        k_next, v_next, kb_next, vb_next = k_words, v_words, k_bits, v_bits
    sk, ok_k = _tile_slots(tile_start + PREFETCH, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                           WIDE_OFFSETS)
    ss, ok_s = _tile_slots(tile_start + PREFETCH, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                           WIDE_OFFSETS)
    for tile in range(tile_start, tile_end):
        k_cur = k_words
        v_cur = v_words
        kb_cur = k_bits
        vb_cur = v_bits
        if PREFETCH == 2:
            k_words, v_words, k_bits, v_bits = k_next, v_next, kb_next, vb_next
            k_next, v_next, kb_next, vb_next = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot, D,
                                                           K_WORDS, V_WORDS)
        else:
            k_words, v_words, k_bits, v_bits = _tile_codes(sk, ok_k, ss, ok_s, head_ptr, stride_slot, D,
                                                           K_WORDS, V_WORDS)
        sk, ok_k = _tile_slots(tile + PREFETCH + 1, tile_end, slot_row_ptr, seq_len, W, TN, L_KS,
                           WIDE_OFFSETS)
        ss, ok_s = _tile_slots(tile + PREFETCH + 1, tile_end, slot_row_ptr, seq_len, W, TN, L_TOK,
                           WIDE_OFFSETS)

        s = mma_v2(q_op, _k_operand(k_cur, DOT_DTYPE, BIAS, B_OP), gl.zeros([W, R, TN], gl.float32, MMA))
        k_zero = ((kb_cur & 0xF) + CODE_BIAS).to(gl.float32)
        s = s - gl.expand_dims(q_sum, 2) * gl.expand_dims(k_zero, 1)
        s = s * gl.expand_dims((kb_cur & -16).to(gl.float32, bitcast=True) * qk_scale, 1)
        pos = _token_index(tile, W, TN, L_TOK)
        visible = gl.expand_dims(pos < seq_len, 1) & (gl.expand_dims(pos, 1) <= gl.expand_dims(q_abs_pos, 2))
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 2))
        m_safe = gl.where(m_new > float("-inf"), m_new, 0.0)
        p = gl.exp2(s - gl.expand_dims(m_safe, 2))
        alpha = gl.exp2(m_i - m_safe)
        alpha3 = gl.expand_dims(alpha, 2)
        p_sums = p_sums * alpha3 + p
        p_dot = (p * gl.expand_dims((vb_cur & -16).to(gl.float32, bitcast=True), 1)).to(DOT_DTYPE)
        v_zero = ((vb_cur & 0xF) + CODE_BIAS).to(gl.float32)
        z_sums = z_sums * alpha3 + p_dot.to(gl.float32) * gl.expand_dims(v_zero, 1)
        # P^T of the first RO rows is already where the dot's second operand is (a register's two
        # tokens, a lane's row); alpha moves to acc^T's columns by shuffles within the warp.
        p_t = gl.convert_layout(gl.permute(_first_rows(p_dot), [0, 2, 1]), B_OP)
        alpha_t = gl.expand_dims(gl.convert_layout(_first_rows(alpha), L_ACC_ROW), 1)
        acc = mma_v2(_v_operand(v_cur, DOT_DTYPE, BIAS, A_OP), p_t, acc * alpha_t)
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
    ROW2: gl.constexpr = ROWS_2D
    # The inverse rotation (vLLM's single_rht(x, inverse=True) / D).
    acc = _fwht(gl.convert_layout(_from_v_order(gl.permute(acc, [1, 0])), ROW2), LOG2_D)
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
# KV tiles a warp's loads run ahead of its arithmetic (1 or 2; registers hold them).
PREFETCH = 1
_launch = CompiledLaunch(_int4_decode_kernel)


def serves(query: Tensor, group: int) -> bool:
    """Whether this kernel can take a launch's short requests: bf16/fp16 queries, head 64 or 128,
    a GQA group of at most ``ROWS_OUT``, an sm_80+ GPU (``mma_v2``), and ``launch_args.INT4_DECODE``
    says so (the benchmarks' switch)."""
    return (launch_args.INT4_DECODE == "gluon" and query.is_cuda
            and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] in (64, 128)
            and group <= ROWS_OUT and torch.cuda.get_device_capability(query.device)[0] >= 8)


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
    constexprs = (head_size, group, num_splits > 1, dot, wide, PREFETCH)
    args = (*tensors, float(scale) / head_size * _LOG2_E, row_limit, num_splits, *strides, *constexprs,
            *_layouts(NUM_WARPS, head_size))
    key = (query.device.index, tensor_key(tensors), strides[:-2], constexprs, NUM_WARPS)
    return _launch, (num_requests, num_kv_heads, num_splits), args, key, {"num_warps": NUM_WARPS}
