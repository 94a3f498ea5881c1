"""Device-side building blocks of the attention recipes: the online-softmax step and the key loop over one chunk.

Plain Triton functions (no host code), inlined into the kernels that call them
(``kraken/fused/context_parallel_attention.py``).
"""

from __future__ import annotations

import triton
import triton.language as tl

# A masked key's score (after scaling): finite, so a row whose first tile were all masked would not turn into NaN.
MASKED_SCORE = -1.0e30
_MASKED_SCORE = tl.constexpr(MASKED_SCORE)  # Triton reads module globals only as constexprs


@triton.jit
def softmax_step(qk, m_i, l_i, acc, qk_scale, keep, MASKED: tl.constexpr):
    """One online-softmax step on a key tile's raw scores ``qk`` (MASKED: only where ``keep``, the rest scored
    ``MASKED_SCORE``): the probabilities ``p`` (exp2, the scale folded in), the new row max and row sum, and ``acc``
    rescaled to the new max, ready for ``acc += p @ v``. Both kernels' key loops take it."""
    if MASKED:
        qk = tl.where(keep, qk * qk_scale, _MASKED_SCORE)
        m_ij = tl.maximum(m_i, tl.max(qk, 1))
        qk = qk - m_ij[:, None]
    else:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        qk = qk * qk_scale - m_ij[:, None]
    p = tl.math.exp2(qk)
    alpha = tl.math.exp2(m_i - m_ij)
    return p, m_ij, l_i * alpha + tl.sum(p, 1), acc * alpha[:, None]


@triton.jit
def attend(acc, m_i, l_i, q, k_desc, v_desc, k_row0, v_row0, lo, hi, q_limit, qk_scale,
           MASKED: tl.constexpr, BLOCK_N: tl.constexpr):
    """Online softmax over keys ``lo .. hi`` of one chunk (rows ``k_row0 + ...`` of ``k_desc``, ``v_row0 + ...``
    of ``v_desc``). MASKED: key ``j`` counts for query row ``i`` only if ``j <= q_limit[i]`` and ``j < hi``."""
    for start in tl.range(lo, hi, BLOCK_N):
        k = k_desc.load([k_row0 + start, 0])
        cols = start + tl.arange(0, BLOCK_N)
        keep = (cols[None, :] <= q_limit[:, None]) & (cols[None, :] < hi)
        p, m_ij, l_i, acc = softmax_step(tl.dot(q, k.T), m_i, l_i, acc, qk_scale, keep, MASKED)
        v = v_desc.load([v_row0 + start, 0])
        if MASKED:
            # Rows past the chunk: another head's values, or a piece still in flight (any bits, NaN too).
            v = tl.where((cols < hi)[:, None], v, tl.zeros_like(v))
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, m_i, l_i

