"""Acceptance rules: greedy matching, and speculative sampling keeps the target's distribution.

The sampling check: a Markov target p(next | prev) and a different Markov draft
q(next | prev) over a 4-token vocabulary; N requests decode L = 3 tokens each with
k = 3 drafts per round (several rounds, rejections at every index). The empirical
distribution of the 4**3 sequences is compared with the exact target distribution
by a seeded chi-square test at the 0.999 quantile; two wrong rules (accept every
draft; after a rejection resample from p instead of the residual max(0, p - q))
fail the same test, so it can tell.

With top-k / top-p (`Sampler.probs`, the front ends' `filter_logits`) the same check
runs against the *filtered* target: drafts are drawn from the filtered draft, and the
rule sees both filtered distributions. Two wrong wirings fail it: the target's
probabilities unfiltered (tokens outside top-k / top-p come out), and the draft's
unfiltered in the acceptance ratio while the drafts were drawn from the filtered one.
"""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch

from cp_compile.serving.spec_decode import Sampler, greedy_accept, rejection_sample
from cp_compile.serving.spec_decode.acceptance import Accepted, _emit, _leading

V, K, L, N = 4, 3, 3, 20000


@pytest.fixture(autouse=True)
def _one_thread():
    """[20000, 4] tensors: intra-op threads only contend (10x slower on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _markov(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(2.0 * torch.randn(V, V, generator=g), dim=-1)  # [prev, next]


P, Q = _markov(0), _markov(1)


def _spec_sequences(rule: Callable[..., Accepted], seed: int, p: torch.Tensor = P, q: torch.Tensor = Q,
                    p_rule: torch.Tensor | None = None, q_rule: torch.Tensor | None = None) -> torch.Tensor:
    """[N, L] tokens decoded with drafts from q, verified against p by `rule` (which sees
    p_rule / q_rule instead where given: a wrong wiring)."""
    p_rule, q_rule = p if p_rule is None else p_rule, q if q_rule is None else q_rule
    g = torch.Generator().manual_seed(seed)
    out = torch.full((N, L + K + 1), -1, dtype=torch.int64)
    n = torch.zeros(N, dtype=torch.int64)  # tokens emitted so far
    last = torch.zeros(N, dtype=torch.int64)  # the context's last token (start token 0)
    while bool((n < L).any()):
        drafts, prev = [], last
        for _ in range(K):
            prev = torch.multinomial(q[prev], 1, generator=g)[:, 0]
            drafts.append(prev)
        d = torch.stack(drafts, dim=1)  # [N, K]
        ctx = torch.cat([last[:, None], d], dim=1)  # [N, K + 1]: the token before each scored position
        acc = rule(d, q_rule[ctx[:, :K]], p_rule[ctx], g)
        # Emit the a + 1 tokens of each request still short of L (the prefix is what counts).
        j = torch.arange(K + 1)[None, :]
        live = (j <= acc.num_accepted[:, None]) & (n < L)[:, None]  # [N, K + 1]
        cols = torch.where(live, n[:, None] + j, torch.full_like(j, L + K))  # spare column for the rest
        out.scatter_(1, cols, torch.where(live, acc.tokens, out.gather(1, cols)))
        last = torch.where(n < L, acc.tokens.gather(1, acc.num_accepted[:, None])[:, 0], last)
        n = torch.where(n < L, n + acc.num_accepted + 1, n)
    return out[:, :L]


def _chi2(seqs: torch.Tensor, p: torch.Tensor = P) -> tuple[float, int]:
    """(chi-square over the sequences target p can emit, inf if any other came out; its df)."""
    idx = (seqs * torch.tensor([V * V, V, 1])).sum(1)
    counts = torch.bincount(idx, minlength=V ** L).double()
    x = torch.arange(V ** L)
    a, b, c = x // (V * V), (x // V) % V, x % V
    expected = N * (p[0, a] * p[a, b] * p[b, c]).double()
    support = expected > 0
    if bool((counts[~support] > 0).any()):
        return float("inf"), int(support.sum()) - 1
    return float(((counts - expected)[support] ** 2 / expected[support]).sum()), int(support.sum()) - 1


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
    chi2, df = _chi2(_spec_sequences(rejection_sample, seed))
    assert df == V ** L - 1 and chi2 < _chi2_quantile_999(df)  # limit about 103 for 63 degrees of freedom


@pytest.mark.parametrize("wrong", [_accept_all, _resample_from_p])
def test_a_wrong_acceptance_rule_fails_the_same_check(wrong):
    chi2, df = _chi2(_spec_sequences(wrong, 0))
    assert chi2 > 3 * _chi2_quantile_999(df)


FILTERS = {"top_k=3": dict(top_k=3), "top_k=3,top_p=0.8": dict(top_k=3, top_p=0.8)}


def _filtered(**f: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The Markov target and draft through the sampler's filter (logits log P, log Q; T = 1)."""
    s = Sampler(temperature=1.0, **f)
    return s.probs(P.log()), s.probs(Q.log())


@pytest.mark.parametrize("filt", list(FILTERS))
def test_speculative_sampling_keeps_the_filtered_target_distribution(filt):
    p, q = _filtered(**FILTERS[filt])
    assert bool((p == 0).any()) and not torch.equal(p == 0, q == 0)  # the filters cut, and cut differently
    chi2, df = _chi2(_spec_sequences(rejection_sample, 0, p, q), p)
    assert chi2 < _chi2_quantile_999(df), (filt, chi2, df)


@pytest.mark.parametrize("filt", list(FILTERS))
@pytest.mark.parametrize("wrong", ["target unfiltered", "draft unfiltered in the ratio"])
def test_a_wrong_filter_wiring_fails_the_same_check(filt, wrong):
    p, q = _filtered(**FILTERS[filt])
    kw = dict(p_rule=P) if wrong == "target unfiltered" else dict(q_rule=Q)
    chi2, df = _chi2(_spec_sequences(rejection_sample, 0, p, q, **kw), p)
    assert chi2 > 3 * _chi2_quantile_999(df), (filt, wrong, chi2, df)


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
    with pytest.raises(ValueError, match="top_p"):
        Sampler(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        Sampler(temperature=1.0, top_k=-2)


def test_rejection_sampling_with_equal_distributions_accepts_everything():
    # p == q: every draft is accepted (u * q < p for every u < 1), the residual is never used.
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(64, K + 1, V, generator=g), -1)
    d = torch.multinomial(p[:, :K].reshape(-1, V), 1, generator=g).view(64, K)
    assert rejection_sample(d, p[:, :K], p, g).num_accepted.tolist() == [K] * 64
