"""Acceptance rules: greedy matching, and speculative sampling keeps the target's distribution.

The sampling check: a Markov target p(next | prev) and a different Markov draft
q(next | prev) over a 4-token vocabulary; N requests decode L = 3 tokens each with
k = 3 drafts per round (several rounds, rejections at every index). The empirical
distribution of the 4**3 sequences is compared with the exact target distribution
by a seeded chi-square test at the 0.999 quantile; two wrong rules (accept every
draft; after a rejection resample from p instead of the residual max(0, p - q))
fail the same test, so it can tell.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch

from cp_compile.spec_decode import Sampler, greedy_accept, rejection_sample
from cp_compile.spec_decode.acceptance import Accepted, _emit, _leading

V, K, L, N = 4, 3, 3, 20000


def _markov(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(V, V, generator=g), dim=-1)  # [prev, next]


P, Q = _markov(0), _markov(1)


def _spec_sequences(rule: Callable[..., Accepted], seed: int) -> torch.Tensor:
    """[N, L] tokens decoded with drafts from Q, verified against P by `rule`."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((N, L + K + 1), -1, dtype=torch.int64)
    n = torch.zeros(N, dtype=torch.int64)  # tokens emitted so far
    last = torch.zeros(N, dtype=torch.int64)  # the context's last token (start token 0)
    while bool((n < L).any()):
        drafts, prev = [], last
        for _ in range(K):
            prev = torch.multinomial(Q[prev], 1, generator=g)[:, 0]
            drafts.append(prev)
        d = torch.stack(drafts, dim=1)  # [N, K]
        ctx = torch.cat([last[:, None], d], dim=1)  # [N, K + 1]: the token before each scored position
        acc = rule(d, Q[ctx[:, :K]], P[ctx], g)
        # Emit the a + 1 tokens of each request still short of L (the prefix is what counts).
        j = torch.arange(K + 1)[None, :]
        live = (j <= acc.num_accepted[:, None]) & (n < L)[:, None]  # [N, K + 1]
        cols = torch.where(live, n[:, None] + j, torch.full_like(j, L + K))  # spare column for the rest
        out.scatter_(1, cols, torch.where(live, acc.tokens, out.gather(1, cols)))
        last = torch.where(n < L, acc.tokens.gather(1, acc.num_accepted[:, None])[:, 0], last)
        n = torch.where(n < L, n + acc.num_accepted + 1, n)
    return out[:, :L]


def _chi2(seqs: torch.Tensor) -> float:
    idx = (seqs * torch.tensor([V * V, V, 1])).sum(1)
    counts = torch.bincount(idx, minlength=V ** L).double()
    x = torch.arange(V ** L)
    a, b, c = x // (V * V), (x // V) % V, x % V
    expected = N * (P[0, a] * P[a, b] * P[b, c]).double()
    return float(((counts - expected) ** 2 / expected).sum())


def _chi2_quantile_999(df: int) -> float:
    """Wilson-Hilferty approximation of the chi-square 0.999 quantile."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _accept_all(d, q, p, g) -> Accepted:
    return _emit(d, torch.full((d.shape[0],), d.shape[1]), torch.multinomial(p[:, -1], 1, generator=g)[:, 0])


def _resample_from_p(d, q, p, g) -> Accepted:
    """Right acceptance test, wrong correction: draws the rejected slot from p."""
    u = torch.rand(d.shape, generator=g)
    a = _leading(u * q.gather(2, d[..., None])[..., 0] < p[:, :-1].gather(2, d[..., None])[..., 0])
    p_a = p.gather(1, a[:, None, None].expand(-1, 1, V))[:, 0]
    return _emit(d, a, torch.multinomial(p_a, 1, generator=g)[:, 0])


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_sampling_keeps_the_target_distribution(seed):
    limit = _chi2_quantile_999(V ** L - 1)  # about 103 for 63 degrees of freedom
    assert _chi2(_spec_sequences(rejection_sample, seed)) < limit


@pytest.mark.parametrize("wrong", [_accept_all, _resample_from_p])
def test_a_wrong_acceptance_rule_fails_the_same_check(wrong):
    assert _chi2(_spec_sequences(wrong, 0)) > 3 * _chi2_quantile_999(V ** L - 1)


def test_greedy_accepts_the_matching_prefix_and_adds_the_target_token():
    logits = torch.full((3, 4, 10), -1.0)
    best = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]])
    logits.scatter_(2, best[..., None], 1.0)
    draft = torch.tensor([[5, 6, 0], [0, 2, 3], [9, 9, 9]])
    acc = greedy_accept(draft, logits)
    assert acc.num_accepted.tolist() == [2, 0, 3]
    assert [acc.emitted(b) for b in range(3)] == [[5, 6, 7], [1], [9, 9, 9, 9]]
    assert acc.tokens[1].tolist() == [1, -1, -1, -1]


def test_shapes_and_sampler_values_are_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"\[B, k \+ 1, vocab\]"):
        greedy_accept(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, 5))
    for bad in (-1.0, float("nan"), float("inf"), True):
        with pytest.raises(ValueError, match="temperature"):
            Sampler(temperature=bad)


def test_rejection_sampling_with_equal_distributions_accepts_everything():
    # p == q: every draft is accepted (u * q < p for every u < 1), the residual is never used.
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, K + 1, V, generator=g), -1)
    d = torch.multinomial(p[:, :K].reshape(-1, V), 1, generator=g).view(64, K)
    assert rejection_sample(d, p[:, :K], p, g).num_accepted.tolist() == [K] * 64
