"""Property tests of the PCP token split and layout helpers (cp_compile.ops.core.pcp_layout).

Checked against brute force: every real token on exactly one PCP rank, padding on
none, each rank's tokens a head chunk plus the mirrored tail chunk of every request,
rank counts balanced, the padded table / local query_start_loc / gather order
consistent with the split, and the cp rank order matching ascending global ranks.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_compile.ops.core import pcp_layout as P

SETTINGS = settings(max_examples=150, deadline=None)


@st.composite
def batches(draw):
    """(pcp, query_start_loc [B+1] int32, num_tokens incl. padding)."""
    pcp = draw(st.sampled_from([1, 2, 3, 4]))
    lens = draw(st.lists(st.one_of(st.integers(0, 2 * pcp), st.integers(0, 40)), min_size=1, max_size=6))
    pad = draw(st.integers(0, 5))
    qsl = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return pcp, qsl, int(qsl[-1]) + pad, lens


def _chunks_bf(n: int, pcp: int) -> list[list[int]]:
    """Brute force: 2*pcp contiguous chunks of range(n), chunk c = [floor(c n/2p), floor((c+1) n/2p))."""
    return [list(range(c * n // (2 * pcp), (c + 1) * n // (2 * pcp))) for c in range(2 * pcp)]


def _split(qsl: torch.Tensor, T: int, pcp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s token indices in global order, straight from the owner map."""
    return torch.nonzero(P.pcp_token_rank(qsl, T, pcp=pcp) == rank).flatten()


@SETTINGS
@given(batches())
def test_every_token_on_exactly_one_rank_head_tail(case):
    pcp, qsl, T, lens = case
    owner = P.pcp_token_rank(qsl, T, pcp=pcp)
    splits = [_split(qsl, T, pcp, r) for r in range(pcp)]
    # Padding on no rank; every real token on exactly one.
    assert bool((owner[int(qsl[-1]):] == -1).all())
    allidx = torch.cat(splits)
    assert torch.equal(torch.sort(allidx).values, torch.arange(int(qsl[-1])))
    for r, s in enumerate(splits):
        assert torch.equal(s, torch.sort(s).values)  # global flattened order
        assert bool((owner[s] == r).all())
    # Head-tail: rank r holds exactly chunks r and 2p-1-r of every request.
    for b, n in enumerate(lens):
        start = int(qsl[b])
        ch = _chunks_bf(n, pcp)
        for r in range(pcp):
            want = sorted(ch[r] + ch[2 * pcp - 1 - r])
            got = [int(i) - start for i in splits[r] if start <= int(i) < start + n]
            assert got == want, (b, n, r, got, want)
            # Balanced: each rank holds n/p tokens of the request, up to rounding.
            assert abs(len(got) - n / pcp) <= 2


@SETTINGS
@given(batches())
def test_table_local_qsl_and_restore_order(case):
    pcp, qsl, T, lens = case
    table = P.pcp_token_table(qsl, T, pcp=pcp)
    counts = [_split(qsl, T, pcp, r).numel() for r in range(pcp)]
    assert table.shape == (pcp, max(max(counts), 1))
    for r in range(pcp):
        row = table[r]
        assert torch.equal(row[: counts[r]], _split(qsl, T, pcp, r))
        assert bool((row[counts[r]:] == -1).all())
        # Local query_start_loc: rank r's tokens of request b sit at [lq[b], lq[b+1]).
        lq = P.pcp_local_query_start_loc(row, qsl)
        assert lq.dtype == torch.int32 and int(lq[0]) == 0 and int(lq[-1]) == counts[r]
        for b in range(len(lens)):
            seg = row[int(lq[b]): int(lq[b + 1])]
            assert bool(((seg >= qsl[b]) & (seg < qsl[b + 1])).all())
    # Rank-major gather -> global order: flat[inv[t]] == t for every real token.
    flat = table.flatten()
    inv = P.restore_order(flat, T)
    real = torch.arange(int(qsl[-1]))
    assert torch.equal(flat[inv[real]], real)
    assert bool(((inv >= 0) & (inv < flat.numel())).all())


def test_short_requests_and_examples():
    # One request of 1 token, one of 3, one of 8, pcp = 2 (4 chunks), 2 padding tokens.
    qsl = torch.tensor([0, 1, 4, 12], dtype=torch.int32)
    owner = P.pcp_token_rank(qsl, 14, pcp=2)
    # n=1: chunks [],[],[],[0] -> rank 0.  n=3: [],[0],[1],[2] -> ranks 1,1,0.
    # n=8: [0,1],[2,3],[4,5],[6,7] -> ranks 0,0,1,1,1,1,0,0.
    assert owner.tolist() == [0, 1, 1, 0, 0, 0, 1, 1, 1, 1, 0, 0, -1, -1]


@given(st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2]))
def test_cp_rank_is_group_rank_of_ascending_world_ranks(pcp, tp, dcp_div):
    """cp rank == index in the ascending list of world ranks sharing the rank's DCP slot."""
    dcp = min(dcp_div * 1, tp) if tp % (dcp_div) == 0 else 1
    for world_rank in range(pcp * tp):
        pcp_rank, tp_rank = divmod(world_rank, tp)  # parallel_state.py: pcp-major world
        group = tp_rank // dcp
        peers = sorted(g * tp + group * dcp + j for g in range(pcp) for j in range(dcp))
        assert peers.index(world_rank) == P.cp_rank(pcp_rank=pcp_rank, dcp=dcp, dcp_rank=tp_rank % dcp)
    assert P.cp_size(pcp=pcp, dcp=dcp) == pcp * dcp
