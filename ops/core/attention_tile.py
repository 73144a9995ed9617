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


# ----------------------------------------------------------------------------- LSE merge
# The merge of partial attentions by their LSEs (docs/architecture.md §5, decision 47):
# LSE = logsumexp_n lse_n, out = sum_n out_n exp(lse_n - LSE). Shared by the DCP merges
# (merge/triton_merge.py: all-to-all combine and LSE rescale), the split-KV decode's
# second stage (paged/triton_decode.py) and any other kernel that merges partials. Rows
# are a block of BLOCK_R (token, head) rows; partial n of a row sits at the row's offset
# plus n x the partial stride, the offsets advanced by the stride, never n x stride.


@triton.jit
def lse_merge_max(lse_ptr, l_off, s_ln, N, r_mask, BLOCK_R: tl.constexpr):
    """Pass 1 of an LSE merge over the N partials of BLOCK_R rows: (m_safe [R], bad [R]).

    lse_ptr + l_off [R] is partial 0's LSE of each row, partial n's is n x s_ln further.
    m_safe: the rows' max finite-or--inf LSE, 0 where every partial is empty (-inf), so
    exp(lse - m_safe) is exactly 0 for empty partials and never NaN (-inf - -inf).
    bad: some partial's LSE is NaN or +inf, an invalid partial, not an empty one
    (decision 47): the caller makes the row NaN."""
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    bad = tl.zeros([BLOCK_R], dtype=tl.int1)
    for n in range(0, N):
        l = tl.load(lse_ptr + l_off, mask=r_mask, other=float("-inf")).to(tl.float32)
        bad = bad | (l != l) | (l == float("inf"))
        m = tl.maximum(m, tl.where(l != l, float("-inf"), l))
        l_off += s_ln
    return tl.where(tl.abs(m) < float("inf"), m, 0.0), bad


@triton.jit
def lse_total(m_safe, denom, bad):
    """The merged LSE [R] from lse_merge_max's (m_safe, bad) and denom = sum_n
    exp(lse_n - m_safe): -inf for a row without a non-empty partial, NaN for a bad row."""
    has = denom > 0.0
    lse = tl.where(has, m_safe + tl.log(tl.where(has, denom, 1.0)), float("-inf"))
    return tl.where(bad, float("nan"), lse)


@triton.jit
def lse_logsumexp(lse_ptr, l_off, s_ln, N, r_mask, BLOCK_R: tl.constexpr):
    """The merged LSE [R] alone (logsumexp_n lse_n, the empty / invalid rules of
    lse_total), partials addressed as in lse_merge_max: what an LSE-rescale merge needs
    before it weighs its own partial by exp(lse_own - LSE)."""
    m_safe, bad = lse_merge_max(lse_ptr, l_off, s_ln, N, r_mask, BLOCK_R)
    denom = tl.zeros([BLOCK_R], dtype=tl.float32)
    for n in range(0, N):
        l = tl.load(lse_ptr + l_off, mask=r_mask, other=float("-inf")).to(tl.float32)
        denom += tl.where(l == float("-inf"), 0.0, tl.exp(l - m_safe))
        l_off += s_ln
    return lse_total(m_safe, denom, bad)


@triton.jit
def lse_merge_rows(out_ptr, lse_ptr, o_off, l_off, cols, s_on, s_ln, N, r_mask, tile_mask,
                   BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The LSE merge of N partials for BLOCK_R rows x BLOCK_D columns: (out [R, D] fp32,
    lse [R] fp32).

    out_ptr + o_off[:, None] + cols[None, :] is partial 0's output tile (cols: the
    columns' element offsets, column index x column stride), partial n's is n x s_on
    further; its LSEs as in lse_merge_max. tile_mask [R, D]: the rows and columns that
    exist. An empty partial (lse -inf) weighs 0 and its output is not read into the sum
    (a select, not 0 x garbage: it may be NaN); a row whose partials are all empty is
    out 0, lse -inf; a NaN / +inf LSE makes the row NaN (decision 47)."""
    m_safe, bad = lse_merge_max(lse_ptr, l_off, s_ln, N, r_mask, BLOCK_R)
    denom = tl.zeros([BLOCK_R], dtype=tl.float32)
    num = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for n in range(0, N):
        l = tl.load(lse_ptr + l_off, mask=r_mask, other=float("-inf")).to(tl.float32)
        empty = l == float("-inf")
        w = tl.where(empty, 0.0, tl.exp(l - m_safe))
        o = tl.load(out_ptr + o_off[:, None] + cols[None, :], mask=tile_mask, other=0.0).to(tl.float32)
        denom += w
        num += tl.where(empty[:, None], 0.0, o * w[:, None])
        l_off += s_ln
        o_off += s_on
    has = denom > 0.0
    out = tl.where(has[:, None], num / tl.where(has, denom, 1.0)[:, None], 0.0)
    out = tl.where(bad[:, None], float("nan"), out)
    return out, lse_total(m_safe, denom, bad)
