"""The online-softmax step every KV tile loop of the attention kernel shares (gathered, int4 and
dense-tile reads): one definition, inlined by Triton into each loop."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _online_softmax_step(s, m_i, l_i):
    """Fold one tile's base-2 logits ``s`` [M, N] (masked entries -inf) into the running max
    ``m_i`` and sum ``l_i``: (P of the tile, the factor that rescales what came before, new l, new m)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # Rows that have seen nothing yet (padding rows) keep m = -inf; subtract 0 there, not -inf.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    return p, alpha, l_i * alpha + tl.sum(p, 1), m_new
