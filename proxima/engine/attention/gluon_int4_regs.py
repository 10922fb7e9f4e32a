"""Registers of the Gluon int4 decode kernel (``gluon_int4_decode``): where each code, query and
accumulator value lives, and the in-register steps between those places (nibble unpacking, the
orders of the head dimension, the Walsh-Hadamard butterflies).

Layer: Gluon device functions and the layouts they assume; the kernel, its launch and why it
exists are in ``gluon_int4_decode``.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

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
        **rotation_layouts(w, d),
    )


def rotation_layouts(num_warps: int, head_size: int) -> dict:
    """Where the rotations' 8 rows of D live: a quarter row a thread (D/4 positions in registers, 4
    lanes a row, 8 rows on a warp's lanes), so a thread's butterflies are a quarter of a row's.
    ``*_EARLY``: positions' low bits in registers (every butterfly stage but the last two);
    ``*_LATE``: the two top bits in registers instead (the last two; ``_fwht`` converts, within a
    warp). ``Q_*`` [W * 8, D]: the queries, warp w holding rows 8w..8w+7 (each warp the same 8
    queries: its own copy for its dot); ``O_*`` [8, D]: the output, every warp the same."""
    w, d = num_warps, head_size
    reg_bits = _bits(d) - 2
    rows = [[1, 0], [2, 0], [4, 0]]
    low = [[0, 1 << i] for i in range(reg_bits)]
    top = [[0, 1 << reg_bits], [0, 2 << reg_bits]]

    def layout(regs: list, lanes: list, warps: list, shape: list):
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=rows + lanes, warp_bases=warps,
                                          block_bases=[], shape=shape)

    q_warps = [[8 << i, 0] for i in range(_bits(w))]
    o_warps = [[0, 0] for _ in range(_bits(w))]
    late_regs, late_lanes = low[:-2] + top, low[-2:]
    return dict(
        Q_EARLY=layout(low, top, q_warps, [8 * w, d]),
        Q_LATE=layout(late_regs, late_lanes, q_warps, [8 * w, d]),
        O_EARLY=layout(low, top, o_warps, [8, d]),
        O_LATE=layout(late_regs, late_lanes, o_warps, [8, d]),
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
def _fwht(x, LOG2_D: gl.constexpr, LATE: gl.constexpr):
    """``x @ H`` for [M, D] float32 (``triton_int4._fwht``) in ``rotation_layouts``' EARLY layout:
    the last two stages in LATE, where their pairs are in one thread's registers."""
    for i in gl.static_range(LOG2_D):
        if i == LOG2_D - 2:
            x = gl.convert_layout(x, LATE)
        x = _butterfly_stage(x, 1 << i)
    return x
