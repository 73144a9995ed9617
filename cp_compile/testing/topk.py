"""Top-k comparisons that hold on any CPU (issue 19).

Two code paths that score the same keys (a token-sharded indexer and the single-device
one, an fp32 op and a float64 loop) agree on the scores only to rounding, so two keys
whose scores are within rounding of each other may come out in either order, or swap
at the top-k boundary, on a CPU that reduces in another order. What is really identical
is the *set of scores* selected: each path's indices must be a top-k of the reference
scores (descending, nothing left out that scores higher, -1 padding exactly where a row
has fewer than k keys), and the two selected score lists must agree to a tolerance.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core.layout import request_index
from cp_compile.ops.core.paged_cache import gather_request_pages


def index_scores(q_i: torch.Tensor, index_cache: torch.Tensor, w: torch.Tensor, block_table: torch.Tensor,
                 req: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
    """Lightning-indexer scores in float64 -> [T, n_max], -inf past each row's causal length.

    q_i [T, Hi, Di], index_cache [NB, BS, Di], w [T, Hi], req [T] (-1 = padding row),
    kv_lens [T]: row t scores positions 0..kv_lens[t]-1 of request req[t].
    """
    T = q_i.shape[0]
    n_max = max(int(kv_lens.max()) if T else 0, 1)
    out = torch.full((T, n_max), float("-inf"), dtype=torch.float64)
    for t in range(T):
        n = int(kv_lens[t])
        if int(req[t]) < 0 or n <= 0:
            continue
        k = gather_request_pages(index_cache, block_table[int(req[t])], n).double()  # [n, Di]
        dots = torch.einsum("hd,sd->hs", q_i[t].double(), k)
        out[t, :n] = (w[t].double()[:, None] * torch.relu(dots)).sum(0)
    return out


def scores_for_step(q_i, index_cache, w, block_table, query_start_loc, kv_lens) -> torch.Tensor:
    """`index_scores` for a step's tokens in order (request of each row from query_start_loc)."""
    return index_scores(q_i, index_cache, w, block_table, request_index(query_start_loc, q_i.shape[0]), kv_lens)


def _selected_scores(idx: torch.Tensor, scores: torch.Tensor, tol: float, what: str) -> list[torch.Tensor]:
    """Checks idx [T, k] is a top-k of scores [T, n]; returns each row's selected scores (descending)."""
    T, k = idx.shape
    assert scores.shape[0] == T, (what, tuple(scores.shape), tuple(idx.shape))
    picked = []
    for t in range(T):
        row, s = idx[t].long(), scores[t]
        n = int(torch.isfinite(s).sum())
        m = min(n, k)
        assert (row[:m] >= 0).all() and (row[m:] == -1).all(), f"{what} row {t}: {row.tolist()} with {n} keys"
        sel = row[:m]
        assert sel.unique().numel() == m and (sel < n).all(), f"{what} row {t}: {row.tolist()} with {n} keys"
        vals = s[sel]
        slack = tol * (1.0 + float(s[torch.isfinite(s)].abs().max()) if n else 1.0)
        assert (vals[1:] <= vals[:-1] + slack).all(), f"{what} row {t}: not descending by score: {vals.tolist()}"
        rest = torch.ones(s.shape[0], dtype=torch.bool)
        rest[sel] = False
        rest &= torch.isfinite(s)
        if rest.any() and m:
            assert float(s[rest].max()) <= float(vals.min()) + slack, \
                f"{what} row {t}: left out a key scoring {float(s[rest].max())} > selected {float(vals.min())}"
        picked.append(vals)
    return picked


def assert_same_topk(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor, *, tol: float = 1e-5,
                     what: str = "top-k") -> None:
    """got and want [T, k] are both a top-k of `scores` and select the same scores to `tol`."""
    assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
    for t, (a, b) in enumerate(zip(_selected_scores(got, scores, tol, what),
                                   _selected_scores(want, scores, tol, what + " (reference)"))):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"{what} row {t}")
