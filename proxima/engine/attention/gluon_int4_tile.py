"""One KV tile of the Gluon int4 decode kernel (``gluon_int4_decode``): a warp's slots and codes
loaded straight into the dots' registers, the tile's base-2 logits, and P's weights (V's scales
and zero points).

Layer: Gluon device functions the kernel's loop calls once a tile; where each value lives and the
in-register steps (unpacking, orders, rotations) are ``gluon_int4_regs``'s.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from proxima.engine.attention.gluon_int4_regs import _first_rows, _k_operand


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


@gluon.jit
def _scores(q_op, q_sum, k_words, k_bits, tile, tile_end, seq_len, q_abs_pos, qk_scale,
            DOT_DTYPE: gl.constexpr, BIAS: gl.constexpr, CODE_BIAS: gl.constexpr, W: gl.constexpr,
            R: gl.constexpr, TN: gl.constexpr,
            MMA: gl.constexpr, B_OP: gl.constexpr, L_TOK: gl.constexpr):
    """A tile's base-2 logits [W, R, TN]: the codes' dot with the rotated queries, less the zero
    point's share (q_sum times it), times the scale; -inf past the sequence, the causal edge and
    the split's last tile (a step's second tile may lie past it)."""
    s = mma_v2(q_op, _k_operand(k_words, DOT_DTYPE, BIAS, B_OP), gl.zeros([W, R, TN], gl.float32, MMA))
    k_zero = ((k_bits & 0xF) + CODE_BIAS).to(gl.float32)
    s = s - gl.expand_dims(q_sum, 2) * gl.expand_dims(k_zero, 1)
    s = s * gl.expand_dims((k_bits & -16).to(gl.float32, bitcast=True) * qk_scale, 1)
    pos = _token_index(tile, W, TN, L_TOK)
    visible = gl.expand_dims((pos < seq_len) & (tile < tile_end), 1) \
        & (gl.expand_dims(pos, 1) <= gl.expand_dims(q_abs_pos, 2))
    return gl.where(visible, s, float("-inf"))


@gluon.jit
def _weighted(p, v_bits, DOT_DTYPE: gl.constexpr, CODE_BIAS: gl.constexpr):
    """P times V's scales, in the dot's dtype, and its products with V's zero points (float32),
    whose sums are taken off the output once, after the loop."""
    p_dot = (p * gl.expand_dims((v_bits & -16).to(gl.float32, bitcast=True), 1)).to(DOT_DTYPE)
    v_zero = ((v_bits & 0xF) + CODE_BIAS).to(gl.float32)
    return p_dot, p_dot.to(gl.float32) * gl.expand_dims(v_zero, 1)


@gluon.jit
def _p_operand(p_dot, B_OP: gl.constexpr):
    """P^T of the first RO rows as the output dot's second operand: already where it sits (a
    register's two tokens, a lane's row)."""
    return gl.convert_layout(gl.permute(_first_rows(p_dot), [0, 2, 1]), B_OP)
