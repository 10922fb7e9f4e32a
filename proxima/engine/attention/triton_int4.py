"""int4 per-token-head KV (vLLM 0.26's ``int4_per_token_head``) inside the slot-attention kernel.

The format (``per_token_head.py`` writes it): each (slot, head) record is D/2 bytes of nibble
pairs, low nibble first, of the keys and values rotated by vLLM's randomized Hadamard transform,
and a float32 scale whose 4 low mantissa bits hold the zero point. The kernel attends in that
rotated space: queries are rotated on load (``_rotate_queries``), the accumulator rotated back
before it is stored (``_unrotate``; linear, so split partials and the merge need nothing new).

Dequantisation never touches a tile: q . (s (k - z)) = s (q . k - z sum(q)) and
P (s (v - z)) = (P s) v - (P s) z, so scales and zero points act on the scores' and P's columns.

Decode-shaped tiles (``_paired``) hold the head dimension in the paired order of ``_nibble_pairs``,
which the dots' sums do not see: the rotated queries are put in that order once a program, and the
accumulator back in the natural one before its inverse rotation.
"""

from __future__ import annotations

import triton
import triton.language as tl

from proxima.engine.attention.triton_softmax import _online_softmax_step


@triton.jit
def _attend_int4_tiles(
    q, q_sum, acc, l_i, m_i,
    k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, slot_row_ptr, seq_len, q_abs_pos, qk_scale,
    stride_k_s, stride_v_s, stride_ks_s, tile_start, tile_end,
    HEAD_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PTX: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``triton_query_tile._attend_kv_tiles`` over int4 codes: q rotated, ``q_sum`` its rows' sums.

    Codes are read as 32-bit words (``k_head_ptr`` / ``v_head_ptr`` int32; word w holds positions
    8w..8w+7, low nibble first: 4-byte loads, since a record's bytes are only 8-byte aligned) and
    unpacked in registers by ``_nibbles``; with 16-bit dots a code c enters its dot as bias + c
    (128 in bf16, 1024 in fp16) and the bias joins the zero point. V's correction uses P as
    rounded for its dot, so the bias cancels exactly (up to float32 accumulation). All of a tile's
    loads are issued before its first dot, so V's latency hides behind the scores. ``PREFETCH``
    pipelines the loads of decode-shaped tiles (``_attend_int4_tiles_swapped``)."""
    if _paired(q.shape[0], HEAD_SIZE):
        return _attend_int4_tiles_swapped(
            q, q_sum, acc, l_i, m_i, k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, slot_row_ptr, seq_len,
            q_abs_pos, qk_scale, stride_k_s, stride_v_s, stride_ks_s, tile_start, tile_end,
            HEAD_SIZE, BLOCK_N, DOT_DTYPE, DOT_PRECISION, PTX, PREFETCH)
    shift = (tl.arange(0, HEAD_SIZE) % 8) * 4
    code_bias = _code_bias(DOT_DTYPE)
    for tile in range(tile_start, tile_end):
        offs_n, n_ok, k_words, v_words, k_bits, v_bits = _load_int4_tile(
            tile, k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, slot_row_ptr, seq_len, stride_k_s,
            stride_v_s, stride_ks_s, HEAD_SIZE, BLOCK_N)
        s = tl.dot(q, tl.trans(_nibbles(k_words, shift, DOT_DTYPE)), input_precision=DOT_PRECISION)
        s = s - q_sum[:, None] * ((k_bits & 0xF) + code_bias).to(tl.float32)[None, :]
        s = s * ((k_bits & -16).to(tl.float32, bitcast=True) * qk_scale)[None, :]
        visible = n_ok[None, :] & (offs_n[None, :] <= q_abs_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        p, alpha, l_i, m_new = _online_softmax_step(s, m_i, l_i)  # l: P before V's scales
        p = (p * (v_bits & -16).to(tl.float32, bitcast=True)[None, :]).to(DOT_DTYPE)
        v = _nibbles(v_words, shift, DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        acc -= tl.sum(p.to(tl.float32) * ((v_bits & 0xF) + code_bias).to(tl.float32)[None, :], 1)[:, None]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attend_int4_tiles_swapped(
    q, q_sum, acc, l_i, m_i,
    k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, slot_row_ptr, seq_len, q_abs_pos, qk_scale,
    stride_k_s, stride_v_s, stride_ks_s, tile_start, tile_end,
    HEAD_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PTX: tl.constexpr, PREFETCH: tl.constexpr,
):
    """``_attend_int4_tiles`` for a tile of at most 16 query rows, both dots transposed: scores^T =
    K q^T and acc^T += V^T P^T, so the unpacked codes are the dots' first operand ([BLOCK_N, D] and
    [D, BLOCK_N]: Hopper's wgmma takes it from registers) and the few query rows their narrow side,
    instead of a 16-row tile with 4 useful rows under GQA 4 reading the codes as its second operand
    (sm_90 build of the decode variant, one tile of 128 tokens: 1,356 instructions a thread against
    1,697, IMAD 74 against 399, LDS 27 against 93). The softmax runs along axis 0. q, acc and the
    codes are in the paired order (``_nibble_pairs``).

    ``PREFETCH``: a software pipeline in registers. Each iteration issues the next tile's code and
    scale loads and the slots of the one after before it computes its own, so a tile's two
    dependent memory round trips (slot table, then codes) overlap the previous tile's arithmetic
    instead of following it; without it, a program with one tile in flight waits on every load."""
    code_bias = _code_bias(DOT_DTYPE)
    q_t = tl.trans(q)
    acc_t = tl.trans(acc)
    # P's sums and its zero-point terms per (token, row), kept rescaled like acc and reduced once
    # after the loop: a sum along the tokens crosses warps (shuffles, shared memory, barriers), and
    # two of them a tile cost more than the [BLOCK_N, M] adds that replace them.
    p_sums = tl.zeros([BLOCK_N, q.shape[0]], dtype=tl.float32)
    z_sums = tl.zeros([BLOCK_N, q.shape[0]], dtype=tl.float32)
    l_scale = tl.full([q.shape[0]], 1.0, dtype=tl.float32)
    if PREFETCH:
        slots, ok = _int4_tile_slots(tile_start, tile_end, slot_row_ptr, seq_len, BLOCK_N)
        k_words, v_words, k_bits, v_bits = _int4_tile_codes(
            slots, ok, k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, stride_k_s, stride_v_s, stride_ks_s,
            HEAD_SIZE)
        slots, ok = _int4_tile_slots(tile_start + 1, tile_end, slot_row_ptr, seq_len, BLOCK_N)
        for tile in range(tile_start, tile_end):
            k_cur, v_cur, kb_cur, vb_cur = k_words, v_words, k_bits, v_bits
            # Masked past tile_end: the last iterations' prefetches read nothing.
            k_words, v_words, k_bits, v_bits = _int4_tile_codes(
                slots, ok, k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, stride_k_s, stride_v_s,
                stride_ks_s, HEAD_SIZE)
            slots, ok = _int4_tile_slots(tile + 2, tile_end, slot_row_ptr, seq_len, BLOCK_N)
            acc_t, m_i, l_scale, p_sums, z_sums = _int4_swapped_step(
                q_t, q_sum, acc_t, m_i, l_scale, p_sums, z_sums, tile, seq_len, q_abs_pos, qk_scale,
                k_cur, v_cur, kb_cur, vb_cur, code_bias, BLOCK_N, DOT_DTYPE, DOT_PRECISION, PTX)
    else:
        for tile in range(tile_start, tile_end):
            offs_n, n_ok, k_words, v_words, k_bits, v_bits = _load_int4_tile(
                tile, k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, slot_row_ptr, seq_len, stride_k_s,
                stride_v_s, stride_ks_s, HEAD_SIZE, BLOCK_N)
            acc_t, m_i, l_scale, p_sums, z_sums = _int4_swapped_step(
                q_t, q_sum, acc_t, m_i, l_scale, p_sums, z_sums, tile, seq_len, q_abs_pos, qk_scale,
                k_words, v_words, k_bits, v_bits, code_bias, BLOCK_N, DOT_DTYPE, DOT_PRECISION, PTX)
    acc_t -= tl.sum(z_sums, 0)[None, :]
    return tl.trans(acc_t), l_i * l_scale + tl.sum(p_sums, 0), m_i


@triton.jit
def _int4_swapped_step(
    q_t, q_sum, acc_t, m_i, l_scale, p_sums, z_sums, tile, seq_len, q_abs_pos, qk_scale,
    k_words, v_words, k_bits, v_bits, code_bias,
    BLOCK_N: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, PTX: tl.constexpr,
):
    """One KV tile of ``_attend_int4_tiles_swapped`` from its loaded codes and scale words."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seq_len
    s_t = tl.dot(_nibble_pairs(k_words, DOT_DTYPE, PTX), q_t, input_precision=DOT_PRECISION)
    s_t = s_t - q_sum[None, :] * ((k_bits & 0xF) + code_bias).to(tl.float32)[:, None]
    s_t = s_t * ((k_bits & -16).to(tl.float32, bitcast=True) * qk_scale)[:, None]
    visible = n_ok[:, None] & (offs_n[:, None] <= q_abs_pos[None, :])
    s_t = tl.where(visible, s_t, float("-inf"))
    # _online_softmax_step along axis 0 (l: P before V's scales)
    m_new = tl.maximum(m_i, tl.max(s_t, 0))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p_t = tl.exp2(s_t - m_safe[None, :])
    alpha = tl.exp2(m_i - m_safe)
    l_scale *= alpha
    p_sums = p_sums * alpha[None, :] + p_t
    p_t = (p_t * (v_bits & -16).to(tl.float32, bitcast=True)[:, None]).to(DOT_DTYPE)
    v_t = tl.trans(_nibble_pairs(v_words, DOT_DTYPE, PTX))
    acc_t = acc_t * alpha[None, :] + tl.dot(v_t, p_t, input_precision=DOT_PRECISION)
    zero_points = ((v_bits & 0xF) + code_bias).to(tl.float32)
    z_sums = z_sums * alpha[None, :] + p_t.to(tl.float32) * zero_points[:, None]
    return acc_t, m_new, l_scale, p_sums, z_sums


@triton.jit
def _load_int4_tile(
    tile, k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, slot_row_ptr, seq_len, stride_k_s, stride_v_s,
    stride_ks_s, HEAD_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One KV tile's loads, all issued before its first dot: positions, which are in the sequence,
    K and V code words ``[BLOCK_N, D/8]`` and the scale words (zero point in the low bits)."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < seq_len
    # Table entries at or past seq_len are garbage: masked, never dereferenced.
    slots = tl.load(slot_row_ptr + offs_n, mask=n_ok, other=0).to(tl.int64)
    k_words, v_words, k_bits, v_bits = _int4_tile_codes(
        slots, n_ok, k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, stride_k_s, stride_v_s, stride_ks_s,
        HEAD_SIZE)
    return offs_n, n_ok, k_words, v_words, k_bits, v_bits


@triton.jit
def _int4_tile_slots(tile, tile_end, slot_row_ptr, seq_len, BLOCK_N: tl.constexpr):
    """A tile's slots, and which of them to read: in the sequence, and the tile before tile_end."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = (offs_n < seq_len) & (tile < tile_end)
    return tl.load(slot_row_ptr + offs_n, mask=ok, other=0).to(tl.int64), ok


@triton.jit
def _int4_tile_codes(
    slots, ok, k_head_ptr, v_head_ptr, ks_head_ptr, vs_head_ptr, stride_k_s, stride_v_s, stride_ks_s,
    HEAD_SIZE: tl.constexpr,
):
    """K and V code words ``[BLOCK_N, D/8]`` of these slots and their scale words (zero point in
    the low bits); zeros where not ``ok``."""
    offs_w = tl.arange(0, HEAD_SIZE // 8)
    k_words = tl.load(k_head_ptr + slots[:, None] * stride_k_s + offs_w[None, :], mask=ok[:, None], other=0)
    v_words = tl.load(v_head_ptr + slots[:, None] * stride_v_s + offs_w[None, :], mask=ok[:, None], other=0)
    k_bits = tl.load(ks_head_ptr + slots * stride_ks_s, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    v_bits = tl.load(vs_head_ptr + slots * stride_ks_s, mask=ok, other=0.0).to(tl.int32, bitcast=True)
    return k_words, v_words, k_bits, v_bits


@triton.constexpr_function
def _paired(rows, head_size):
    """Whether a tile of this many query rows runs ``_attend_int4_tiles_swapped``, in the paired
    order: a decode-shaped tile, tokens on the dots' long side. Heads past 128 keep the plain dots
    (the transposed ones spill more there: 2,664 bytes of stack at head 256 in float32, sm_90
    build); longer tiles keep the natural order, their registers at the 255 limit (sm_90 build:
    the paired order made the mixed variant spill 72 bytes)."""
    return rows <= 16 and head_size <= 128


@triton.jit
def _code_bias(DOT_DTYPE: tl.constexpr):
    """What ``_nibbles`` and ``_nibble_pairs`` add to every code (0: converted, not biased)."""
    if DOT_DTYPE == tl.bfloat16:
        return 128
    elif DOT_DTYPE == tl.float16:
        return 1024
    else:
        return 0


@triton.jit
def _nibbles(words, shift, DOT_DTYPE: tl.constexpr):
    """[N, W] int32 words -> [N, 8 W] their nibbles in order (word w's low nibble first), as
    ``DOT_DTYPE`` values ``bias + code``: on 16-bit dtypes the code is OR-ed into
    the bias's mantissa (0x4300 is bf16 128.0, 0x6400 fp16 1024.0), so no conversion instruction
    runs, the costliest step of widening codes on the GPU."""
    x = tl.interleave(words, words)
    x = tl.interleave(x, x)
    x = tl.interleave(x, x)
    codes = (x >> shift[None, :]) & 0xF
    if DOT_DTYPE == tl.bfloat16:
        return (codes | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
    if DOT_DTYPE == tl.float16:
        return (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
    return codes.to(DOT_DTYPE)


@triton.jit
def _nibble_pairs(words, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr):
    """``_nibbles`` in the paired order: column 8w + 2k + e holds word w's nibble k + 4e (k < 4,
    e < 2). Nibbles k and k + 4 lie 16 bits apart, so one shift and one mask take both into the
    halves of a 32-bit register, already the packed pair of adjacent 16-bit columns that the dots'
    operands hold: sm_90 build of the decode variant, one 128-token tile: 647 instructions a thread
    against 776, SHF 54 against 102, PRMT 4 against 68."""
    lo0, hi0 = _pair(words, 0, DOT_DTYPE, PTX)
    lo1, hi1 = _pair(words, 4, DOT_DTYPE, PTX)
    lo2, hi2 = _pair(words, 8, DOT_DTYPE, PTX)
    lo3, hi3 = _pair(words, 12, DOT_DTYPE, PTX)
    lo = tl.interleave(tl.interleave(lo0, lo2), tl.interleave(lo1, lo3))  # column 4w + k: nibble k
    codes = tl.interleave(lo, tl.interleave(tl.interleave(hi0, hi2), tl.interleave(hi1, hi3)))
    if DOT_DTYPE == tl.float32:
        return codes.to(tl.float32)
    else:
        return codes.to(DOT_DTYPE, bitcast=True)


# (x & 0x000F000F) | bias in one instruction: the truth table of (a & b) | c over lop3's operand
# bytes a 0xF0, b 0xCC, c 0xAA. ptxas does not fuse Triton's and + or into one LOP3 (which takes a
# single immediate, and both are constants): sm_90 build of the decode variant, one 128-token tile:
# 584 instructions a thread against 647, LOP3 76 against 140.
_MASK_OR_BIAS = tl.constexpr("lop3.b32 $0, $1, 0x000F000F, $2, 0xEA;")


@triton.jit
def _pair(words, SHIFT: tl.constexpr, DOT_DTYPE: tl.constexpr, PTX: tl.constexpr):
    """Nibbles SHIFT / 4 and SHIFT / 4 + 4 of each word: int16 bias bits | code (bias 0: float32).
    ``PTX`` (a compiled build, 16-bit dtypes): the mask and the bias in one ``_MASK_OR_BIAS``."""
    if DOT_DTYPE == tl.bfloat16:
        bias: tl.constexpr = 0x43004300
    elif DOT_DTYPE == tl.float16:
        bias: tl.constexpr = 0x64006400
    else:
        bias: tl.constexpr = 0
    if PTX and bias != 0:
        pair = tl.inline_asm_elementwise(_MASK_OR_BIAS, "=r,r,n", [words >> SHIFT, bias], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        pair = ((words >> SHIFT) & 0x000F000F) | bias
    return pair.to(tl.int16), (pair >> 16).to(tl.int16)


@triton.jit
def _to_paired_order(x):
    """[M, D] columns from the natural order to ``_nibble_pairs``' (8w + 4e + k -> 8w + 2k + e): a
    register shuffle once a program."""
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, [rows, cols // 8, 2, 4]), [0, 1, 3, 2]), [rows, cols])


@triton.jit
def _from_paired_order(x):
    """The inverse of ``_to_paired_order``."""
    rows: tl.constexpr = x.shape[0]
    cols: tl.constexpr = x.shape[1]
    return tl.reshape(tl.permute(tl.reshape(x, [rows, cols // 8, 4, 2]), [0, 1, 3, 2]), [rows, cols])


@triton.jit
def _hadamard_block(x, rht_ptr, N: tl.constexpr, HEAD_SIZE_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, SPLIT_HI: tl.constexpr):
    """``x @ H_N`` (float32 out) for ``x`` [M, N] float32; H_N is the top-left block of the head's
    Walsh-Hadamard matrix at ``rht_ptr``. ``SPLIT_HI``: x enters as hi + lo halves of DOT_DTYPE
    (~16 mantissa bits from bf16), for an accumulator that bf16 alone would round."""
    offs = tl.arange(0, N)
    h = tl.load(rht_ptr + offs[:, None] * HEAD_SIZE_PAD + offs[None, :]).to(DOT_DTYPE)
    hi = x.to(DOT_DTYPE)
    out = tl.dot(hi, h, input_precision=DOT_PRECISION)
    if SPLIT_HI:
        out += tl.dot((x - hi.to(tl.float32)).to(DOT_DTYPE), h, input_precision=DOT_PRECISION)
    return out


@triton.jit
def _hadamard(x, rht_ptr, HEAD_SIZE_PAD: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
              SPLIT_HI: tl.constexpr):
    """``x @ H`` for ``x`` [M, D] float32. Past 128 columns, one split (H_2n = [[H_n, H_n], [H_n,
    -H_n]]: [a | b] H_2n = [(a + b) H_n | (a - b) H_n]) keeps the matrix tile at 128 x 128."""
    if HEAD_SIZE_PAD > 128:
        rows: tl.constexpr = x.shape[0]
        half: tl.constexpr = HEAD_SIZE_PAD // 2
        a, b = tl.split(tl.permute(tl.reshape(x, [rows, 2, half]), [0, 2, 1]))
        left = _hadamard_block(a + b, rht_ptr, half, HEAD_SIZE_PAD, DOT_DTYPE, DOT_PRECISION, SPLIT_HI)
        right = _hadamard_block(a - b, rht_ptr, half, HEAD_SIZE_PAD, DOT_DTYPE, DOT_PRECISION, SPLIT_HI)
        return tl.reshape(tl.permute(tl.join(left, right), [0, 2, 1]), [rows, HEAD_SIZE_PAD])
    return _hadamard_block(x, rht_ptr, HEAD_SIZE_PAD, HEAD_SIZE_PAD, DOT_DTYPE, DOT_PRECISION, SPLIT_HI)


@triton.constexpr_function
def _log2(n):
    return n.bit_length() - 1


@triton.jit
def _butterfly_stage(x, H: tl.constexpr):
    """One stage of vLLM's Walsh-Hadamard butterfly (``per_token_head._butterfly``): columns
    (2Hj + i, 2Hj + H + i) -> (a + b, a - b), in registers."""
    rows: tl.constexpr = x.shape[0]
    n: tl.constexpr = x.shape[1]
    a, b = tl.split(tl.permute(tl.reshape(x, [rows, n // (2 * H), 2, H]), [0, 1, 3, 2]))
    return tl.reshape(tl.permute(tl.join(a + b, a - b), [0, 1, 3, 2]), [rows, n])


@triton.jit
def _fwht(x):
    """``x @ H`` for ``x`` [M, D] float32 by log2(D) butterfly stages in float32, in place of the
    dots with the [D, D] matrix (a 64 KiB load from L2 per rotation at D 128, two a program)."""
    for i in tl.static_range(_log2(x.shape[1])):
        x = _butterfly_stage(x, 1 << i)
    return x


@triton.jit
def _rotate_queries(q, rht_ptr, signs_ptr, HEAD_SIZE_PAD: tl.constexpr, Q_DTYPE: tl.constexpr,
                    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr, ROT_BUTTERFLY: tl.constexpr):
    """vLLM's int4 query rotation (signs, then the Walsh-Hadamard transform), rounded to the
    model dtype as vLLM rounds it, in the paired order on decode-shaped tiles (``_paired``); and
    the rows' sums (for the zero points). ``ROT_BUTTERFLY``: by ``_fwht``, else by dots with the
    matrix at ``rht_ptr``."""
    signs = tl.load(signs_ptr + tl.arange(0, HEAD_SIZE_PAD))
    if ROT_BUTTERFLY:
        rotated = _fwht(q.to(tl.float32) * signs[None, :])
    else:
        rotated = _hadamard(q.to(tl.float32) * signs[None, :], rht_ptr, HEAD_SIZE_PAD, DOT_DTYPE,
                            DOT_PRECISION, False)
    rotated = rotated.to(Q_DTYPE).to(DOT_DTYPE)
    if _paired(q.shape[0], HEAD_SIZE_PAD):
        rotated = _to_paired_order(rotated)
    return rotated, tl.sum(rotated.to(tl.float32), 1)


@triton.jit
def _unrotate(acc, rht_ptr, signs_ptr, HEAD_SIZE_PAD: tl.constexpr, ROT_DTYPE: tl.constexpr,
              DOT_PRECISION: tl.constexpr, ROT_BUTTERFLY: tl.constexpr):
    """The inverse of ``_rotate_queries`` on an accumulator (linear: partials and unnormalised
    sums alike): vLLM's ``single_rht(x, inverse=True) / D``."""
    if _paired(acc.shape[0], HEAD_SIZE_PAD):
        acc = _from_paired_order(acc)
    if ROT_BUTTERFLY:
        out = _fwht(acc)
    else:
        out = _hadamard(acc, rht_ptr, HEAD_SIZE_PAD, ROT_DTYPE, DOT_PRECISION, ROT_DTYPE != tl.float32)
    signs = tl.load(signs_ptr + tl.arange(0, HEAD_SIZE_PAD))
    return out * (signs / HEAD_SIZE_PAD)[None, :]
