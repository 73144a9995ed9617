"""Property tests of the DCP KV-cache layout math (docs/architecture.md §5, cp_compile.ops.core.layout).

Every function is checked against brute force over request-local positions:
every token is stored on exactly one rank, local slots pack with no holes, local
lengths sum to the total, and the top-k remap agrees with the slot mapping.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cp_compile.ops.core import layout

DCPS = [1, 2, 3, 4, 8]
BLOCK_SIZES = [16, 32]
SETTINGS = settings(max_examples=100, deadline=None)


# ----------------------------------------------------------------------------- strategies


@st.composite
def layouts(draw):
    """(dcp, interleave, block_size) with interleave | block_size."""
    dcp = draw(st.sampled_from(DCPS))
    block_size = draw(st.sampled_from(BLOCK_SIZES))
    interleave = draw(st.sampled_from(sorted({1, 2, 16, block_size})))
    assert block_size % interleave == 0
    return dcp, interleave, block_size


def _length(dcp: int, block_size: int):
    """Request lengths: often tiny (0, < dcp), sometimes several virtual blocks long."""
    vbs = block_size * dcp
    return st.one_of(st.integers(0, 2 * dcp), st.integers(0, 3 * vbs + 5))


@st.composite
def batches(draw, min_requests: int = 1, max_requests: int = 5):
    """A layout, request lengths, and a block table of distinct, shuffled block ids."""
    dcp, interleave, block_size = draw(layouts())
    lens = draw(st.lists(_length(dcp, block_size), min_size=min_requests, max_size=max_requests))
    seed = draw(st.integers(0, 2**31 - 1))
    extra = draw(st.integers(0, 2))  # unused trailing block-table columns
    spare = draw(st.integers(0, 7))  # block ids that no request uses
    g = torch.Generator().manual_seed(seed)
    vbs = block_size * dcp
    nb = max(1, -(-max(lens) // vbs)) + extra
    total = len(lens) * nb
    ids = torch.randperm(total + spare, generator=g)[:total]
    block_table = ids.reshape(len(lens), nb).to(torch.int32)
    return dcp, interleave, block_size, lens, block_table, g


# ----------------------------------------------------------------------------- brute force


def owner_bf(p: int, dcp: int, interleave: int, block_size: int) -> int:
    """Owner by walking the virtual block in interleave-sized chunks, round-robin."""
    off = p % (block_size * dcp)
    return (off // interleave) % dcp


def global_slots(block_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, vbs: int) -> torch.Tensor:
    """Single-device slot mapping with virtual blocks of vbs tokens; -1 where req < 0."""
    r = req.clamp(min=0).long()
    p = pos.clamp(min=0).long()
    slot = block_table[r, p // vbs].long() * vbs + p % vbs
    return torch.where(req >= 0, slot, torch.full_like(slot, -1))


def all_positions(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, position) of every token of every request, request-major."""
    req = torch.cat([torch.full((n,), b, dtype=torch.int64) for b, n in enumerate(lens)]
                    + [torch.zeros(0, dtype=torch.int64)])
    pos = torch.cat([torch.arange(n) for n in lens] + [torch.zeros(0, dtype=torch.int64)])
    return req, pos


# ----------------------------------------------------------------------------- owner / offset


@SETTINGS
@given(batches())
def test_owner_and_offset_store_every_token_once_without_holes(case):
    dcp, interleave, block_size, lens, bt, _ = case
    vbs = block_size * dcp
    req, pos = all_positions(lens)
    owner = layout.token_owner(pos, cp=dcp, interleave=interleave, block_size=block_size)
    off = layout.local_offset(pos, cp=dcp, interleave=interleave, block_size=block_size)

    # Matches the seed formula and lies in a physical page.
    assert torch.equal(owner, (pos % vbs // interleave) % dcp)
    assert bool(((owner >= 0) & (owner < dcp)).all())
    assert bool(((off >= 0) & (off < block_size)).all())

    # Exactly one rank per token.
    one_hot = torch.stack([owner == r for r in range(dcp)])
    assert bool((one_hot.sum(0) == 1).all())

    for r in range(dcp):
        mine = owner == r
        # Inside each (request, virtual block) the owned offsets are 0..k-1 in position order.
        for b, n in enumerate(lens):
            for v in range(-(-n // vbs)):
                sel = mine & (req == b) & (pos // vbs == v)
                got = off[sel]
                assert torch.equal(got, torch.arange(got.numel())), (b, v, r, got)
                full = (v + 1) * vbs <= n
                if full:  # a full virtual block puts exactly block_size tokens on each rank
                    assert got.numel() == block_size
        # No two tokens of any request share a physical slot on this rank.
        local_index = bt[req[mine], pos[mine] // vbs].long() * block_size + off[mine]
        assert local_index.unique().numel() == local_index.numel()


@SETTINGS
@given(layouts(), st.integers(0, 10_000))
def test_owner_matches_brute_force_scalars(lay, p):
    dcp, interleave, block_size = lay
    t = torch.tensor([p])
    assert int(layout.token_owner(t, cp=dcp, interleave=interleave, block_size=block_size)) == owner_bf(p, dcp, interleave, block_size)
    # Local offset = rank of p among the owner's positions of its virtual block.
    vbs = block_size * dcp
    start = p // vbs * vbs
    o = owner_bf(p, dcp, interleave, block_size)
    rank_in_block = sum(owner_bf(q, dcp, interleave, block_size) == o for q in range(start, p))
    assert int(layout.local_offset(t, cp=dcp, interleave=interleave, block_size=block_size)) == rank_in_block


# ----------------------------------------------------------------------------- slot mapping


@SETTINGS
@given(batches(), st.integers(0, 6))
def test_local_slot_mapping(case, num_pad):
    dcp, interleave, block_size, lens, bt, g = case
    vbs = block_size * dcp
    req, pos = all_positions(lens)
    # A random subset of tokens in random order (as a batch would hold), then padding.
    keep = torch.randperm(req.numel(), generator=g)[: int(torch.randint(0, req.numel() + 1, (1,), generator=g))]
    req = torch.cat([req[keep], torch.full((num_pad,), -1, dtype=torch.int64)])
    pos = torch.cat([pos[keep], torch.full((num_pad,), -1, dtype=torch.int64)])
    perm = torch.randperm(req.numel(), generator=g)
    req, pos = req[perm], pos[perm]
    slot = global_slots(bt, req, pos, vbs).to(torch.int32)
    pad = req < 0

    owner = layout.token_owner(pos.clamp(min=0), cp=dcp, interleave=interleave, block_size=block_size)
    off = layout.local_offset(pos.clamp(min=0), cp=dcp, interleave=interleave, block_size=block_size)
    local_all = bt[req.clamp(min=0), pos.clamp(min=0) // vbs].long() * block_size + off

    per_rank = []
    for r in range(dcp):
        got = layout.local_slot_mapping(slot, cp=dcp, rank=r, interleave=interleave, block_size=block_size)
        assert got.shape == slot.shape
        expected = torch.where(~pad & (owner == r), local_all, torch.full_like(local_all, -1))
        assert torch.equal(got.long(), expected), r
        # Owned slots stay inside this rank's cache and never collide.
        owned = got[got >= 0]
        assert bool((owned < (int(bt.max()) + 1) * block_size).all())
        assert owned.unique().numel() == owned.numel()
        per_rank.append(got)
    stacked = torch.stack(per_rank)
    assert bool(((stacked >= 0).sum(0) == (~pad).long()).all())
    assert bool((stacked[:, pad] == -1).all())


# ----------------------------------------------------------------------------- local_len


@SETTINGS
@given(layouts(), st.lists(st.integers(0, 2000), min_size=1, max_size=20))
def test_local_len_sums_matches_brute_force_and_is_monotone(lay, lens):
    dcp, interleave, block_size = lay
    length = torch.tensor(lens, dtype=torch.int32)
    per_rank = torch.stack([layout.local_len(length, cp=dcp, rank=r, interleave=interleave) for r in range(dcp)])
    assert per_rank.dtype == torch.int32
    assert torch.equal(per_rank.sum(0), length)
    assert bool((per_rank >= 0).all())

    # Brute force over every prefix 0..max(lens): counts of owned positions < length.
    n = max(lens) + 1
    prefix = torch.arange(n, dtype=torch.int32)
    owner = layout.token_owner(torch.arange(n), cp=dcp, interleave=interleave, block_size=block_size)
    for r in range(dcp):
        counts = torch.cat([torch.zeros(1, dtype=torch.int64), (owner == r).long().cumsum(0)])[:n]
        got = layout.local_len(prefix, cp=dcp, rank=r, interleave=interleave)
        assert torch.equal(got.long(), counts), r
        # Monotone, +1 exactly when the next position is owned by r.
        step = layout.local_len(prefix + 1, cp=dcp, rank=r, interleave=interleave) - got
        assert torch.equal(step.long(), (owner == r).long())
        # local_len(p) is the packed local index of an owned position p.
        idx = (prefix // (block_size * dcp)) * block_size + layout.local_offset(prefix, cp=dcp, interleave=interleave, block_size=block_size)
        assert torch.equal(got[owner == r], idx[owner == r])


def test_local_len_tiny_sequences_land_on_low_ranks():
    # Fewer tokens than ranks: the first ranks hold one token each, the rest none.
    for dcp in DCPS:
        for n in range(dcp + 1):
            got = [int(layout.local_len(torch.tensor(n), cp=dcp, rank=r, interleave=1)) for r in range(dcp)]
            assert got == [1] * n + [0] * (dcp - n)


# ----------------------------------------------------------------------------- per-token lengths


@st.composite
def step_batches(draw):
    """A layout plus a flattened step: per-request (seq_len, q_len <= seq_len), trailing padding."""
    dcp, interleave, block_size = draw(layouts())
    seq = draw(st.lists(_length(dcp, block_size), min_size=1, max_size=5))
    q = [draw(st.integers(0, min(s, 8))) if draw(st.booleans()) else draw(st.integers(0, s)) for s in seq]
    pad = draw(st.integers(0, 5))
    return dcp, interleave, block_size, seq, q, pad


@SETTINGS
@given(step_batches())
def test_token_positions_and_causal_lens(case):
    dcp, interleave, block_size, seq, q, pad = case
    qsl = torch.tensor([0] + list(torch.tensor(q).cumsum(0).tolist()), dtype=torch.int32)
    seq_lens = torch.tensor(seq, dtype=torch.int32)
    num_tokens = int(qsl[-1]) + pad

    # Brute-force (position, request) of every token.
    exp_pos = [s - ql + i for s, ql in zip(seq, q) for i in range(ql)] + [-1] * pad
    exp_req = [b for b, ql in enumerate(q) for _ in range(ql)] + [-1] * pad
    exp_ctx = [s - ql for s, ql in zip(seq, q) for _ in range(ql)] + [0] * pad

    pos, req = layout.token_positions(qsl, seq_lens, num_tokens)
    assert pos.tolist() == exp_pos
    assert req.tolist() == exp_req
    assert layout.request_index(qsl, num_tokens).tolist() == exp_req
    cl = layout.causal_lens(qsl, seq_lens, num_tokens)
    assert cl.dtype == torch.int32
    assert cl.tolist() == [p + 1 for p in exp_pos]

    n = max(seq) + 1
    owner = layout.token_owner(torch.arange(n), cp=dcp, interleave=interleave, block_size=block_size)
    causal_sum = torch.zeros(num_tokens, dtype=torch.int64)
    for r in range(dcp):
        counts = torch.cat([torch.zeros(1, dtype=torch.int64), (owner == r).long().cumsum(0)])  # [n+1]
        lcl = layout.local_causal_lens(qsl, seq_lens, num_tokens, cp=dcp, rank=r, interleave=interleave)
        assert lcl.dtype == torch.int32 and lcl.shape == (num_tokens,)
        # Keys 0..pos owned by r; padding attends nothing.
        expected = [int(counts[p + 1]) if p >= 0 else 0 for p in exp_pos]
        assert lcl.tolist() == expected, r
        causal_sum += lcl.long()

        lctx = layout.local_context_lens(qsl, seq_lens, num_tokens, cp=dcp, rank=r, interleave=interleave)
        assert lctx.dtype == torch.int32
        assert lctx.tolist() == [int(counts[c]) for c in exp_ctx], r
        assert lctx.tolist() == layout.local_len(torch.tensor(exp_ctx), cp=dcp, rank=r, interleave=interleave).tolist()
    assert causal_sum.tolist() == [p + 1 for p in exp_pos]


# ----------------------------------------------------------------------------- top-k remap


@st.composite
def topk_batches(draw):
    dcp, interleave, block_size, lens, bt, g = draw(batches())
    k = draw(st.integers(1, 24))
    rows_per_req = draw(st.integers(1, 3))
    tail_only = draw(st.booleans())  # -1 only at the tail, or scattered anywhere
    rows, row_req = [], []
    for b, n in enumerate(lens):
        for _ in range(rows_per_req):
            nv = int(torch.randint(0, min(k, n) + 1, (1,), generator=g))
            valid = torch.randperm(n, generator=g)[:nv]
            row = torch.cat([valid, torch.full((k - nv,), -1, dtype=torch.int64)])
            if not tail_only:
                row = row[torch.randperm(k, generator=g)]
            rows.append(row)
            row_req.append(b)
    indices = torch.stack(rows).to(torch.int32)
    return dcp, interleave, block_size, lens, bt, indices, torch.tensor(row_req)


@SETTINGS
@given(topk_batches())
def test_global_to_local_indices(case):
    dcp, interleave, block_size, lens, bt, indices, row_req = case
    vbs = block_size * dcp
    kept_per_rank = []
    for r in range(dcp):
        got = layout.global_to_local_indices(indices, cp=dcp, rank=r, interleave=interleave, block_size=block_size)
        assert got.dtype == indices.dtype and got.shape == indices.shape
        kept_rows = []
        for i in range(indices.shape[0]):
            b = int(row_req[i])
            row = indices[i].tolist()
            out = got[i].tolist()
            want_global = [p for p in row if p >= 0 and owner_bf(p, dcp, interleave, block_size) == r]
            nk = len(want_global)
            # Compacted to the front, -1 tail.
            assert all(j >= 0 for j in out[:nk]) and all(j == -1 for j in out[nk:]), (row, out)
            # Local index -> local slot agrees with the slot mapping of the global position (stable order).
            if nk:
                j = torch.tensor(out[:nk])
                slot_from_local = bt[b, j // block_size].long() * block_size + j % block_size
                p = torch.tensor(want_global)
                gslot = global_slots(bt, torch.full_like(p, b), p, vbs).to(torch.int32)
                lslot = layout.local_slot_mapping(gslot, cp=dcp, rank=r, interleave=interleave, block_size=block_size)
                assert torch.equal(slot_from_local, lslot.long()), (row, out)
                # Inverse map: the token at local index j on rank r is the original position.
                all_p = torch.arange(lens[b])
                mine = all_p[layout.token_owner(all_p, cp=dcp, interleave=interleave, block_size=block_size) == r]
                assert mine[j].tolist() == want_global
            kept_rows.append(want_global)
        kept_per_rank.append(kept_rows)
    # Union over ranks = the original valid entries, each exactly once.
    for i in range(indices.shape[0]):
        union = sorted(p for r in range(dcp) for p in kept_per_rank[r][i])
        assert union == sorted(p for p in indices[i].tolist() if p >= 0)


def test_global_to_local_indices_batched_dims_and_empty():
    g = torch.Generator().manual_seed(0)
    dcp, interleave, block_size = 4, 2, 16
    idx = torch.randint(-1, 500, (3, 5, 7), generator=g, dtype=torch.int32)
    for r in range(dcp):
        got = layout.global_to_local_indices(idx, cp=dcp, rank=r, interleave=interleave, block_size=block_size)
        flat = layout.global_to_local_indices(idx.reshape(-1, 7), cp=dcp, rank=r, interleave=interleave, block_size=block_size)
        assert torch.equal(got.reshape(-1, 7), flat)
    empty = torch.full((2, 4), -1, dtype=torch.int32)
    assert torch.equal(layout.global_to_local_indices(empty, cp=2, rank=0, interleave=1, block_size=16), empty)
    none = torch.zeros((0, 4), dtype=torch.int32)
    assert layout.global_to_local_indices(none, cp=2, rank=1, interleave=1, block_size=16).shape == (0, 4)
