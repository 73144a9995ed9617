"""Triton device functions shared by the attention kernels of the op families
(docs/architecture.md §8): the paged-cache addressing, the online-softmax update of
one key tile and the epilogue with the empty-shard rule of decision 47.

`paged/triton_decode.py`, `paged/triton_prefill.py`, `sparse/triton_sparse_mla.py` and
`sparse/triton_indexer.py` call these from their kernels; each is inlined into its
caller when the kernel compiles (Triton, triton-ascend, the interpreter), so the
lowering check and the AOT check see them inside the kernels that launch them. Not a
`triton_*.py` module: it launches nothing and declares no LOWERING. Imports triton:
imported only by the kernel modules, never at op registration.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_location(bt_ptr, req, s_bt, j, mask, block_size):
    """(page, offset in the page) of request `req`'s request-local positions `j` in a
    paged cache: page `block_table[req, j // block_size]`, offset `j % block_size`.
    Masked-off positions read page 0, always a real page, never an unused table entry."""
    page = tl.load(bt_ptr + req * s_bt + j // block_size, mask=mask, other=0)
    return page, j % block_size


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One key tile of the online softmax: scores s [M, N] fp32 (-inf = masked key), the
    running max m_i [M] and sum l_i [M] -> (p [M, N], alpha [M], m_new, l_new). The
    caller rescales its accumulator by alpha and adds p @ V.

    A row whose tiles so far are all masked has max -inf: it is shifted by 0 instead,
    so p and alpha are exactly 0 (exp(-inf)), never NaN (-inf - -inf); a row with a
    finite max is shifted by it, the usual update."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp(m_i - m_safe)  # exp(-inf) = 0 on a row's first tile with keys
    p = tl.exp(s - m_safe[:, None])  # masked keys -> 0
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def lse_epilogue(acc, l_i, m_i):
    """(out [M, Dv], lse [M]) from the accumulator acc [M, Dv] fp32 and the running sum
    and max. The empty-shard rule (decision 47): a row without keys (l_i = 0) gives
    out 0 and lse -inf, which every merge weighs 0 (only -inf reads as empty)."""
    has = l_i > 0.0
    l_safe = tl.where(has, l_i, 1.0)
    out = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
    lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
    return out, lse
