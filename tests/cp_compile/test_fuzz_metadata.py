"""Fuzz: valid metadata, mutated one field at a time, on one device and on 2 DCP ranks.

Hypothesis draws a mixed batch (context and new tokens per request, padding, block
ids shifted and permuted by earlier allocations) and one mutation: an index out of
range, a wrong dtype, an inconsistent length, a shifted offset, padding in an odd
place, or none. Every example must either be refused with a `MetadataError` that
names the field, the value and a fix, with every cache bit-identical to before, or
be accepted and give exactly what the metadata means: the output of a dense fp64
oracle (single device) and, on the DCP ranks, the single-device op's output and
cache, sharded.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import cp_compile
from cp_compile import MetadataError
from cp_compile.runtime.metadata import AttentionMetadata
from cp_compile.testing.multirank import run_on_ranks

NUM_BLOCKS = 12
VBS = 4  # tokens per (virtual) block: one device's page; 2 tokens per rank at dcp = 2
WIDTH = 5  # block-table columns
HQ, HKV, D = 4, 1, 8
SCALE = 0.35
FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions")
DTYPES = (torch.float32, torch.float64, torch.int16, torch.bool, torch.int32, torch.int64)


@st.composite
def cases(draw: Any) -> dict:
    B = draw(st.integers(1, 3))
    reqs = [(draw(st.integers(0, 12)), draw(st.integers(1, 4))) for _ in range(B)]
    padding = draw(st.integers(0, 2))
    shift = draw(st.integers(0, 8))  # tokens of an earlier request: block ids start elsewhere
    order = draw(st.permutations(list(range(B))))
    T = sum(n for _, n in reqs) + padding
    t = st.integers(0, T - 1)
    b = st.integers(0, B - 1)
    nonzero = st.integers(-4, 4).filter(bool)
    # one_of favours its first branches: the plain valid case goes last.
    mutation = draw(st.one_of(
        st.tuples(st.just("bt"), b, st.integers(0, WIDTH - 1),
                  st.sampled_from([-1, NUM_BLOCKS, NUM_BLOCKS + 7]) | st.integers(0, NUM_BLOCKS - 1)),
        st.tuples(st.just("slot"), t, st.sampled_from([-2, -1, NUM_BLOCKS * VBS, 2**40])
                  | st.integers(0, NUM_BLOCKS * VBS - 1)),
        st.tuples(st.just("slot_shift"), t, st.sampled_from([-1, 1, VBS])),
        st.tuples(st.just("seq"), b, nonzero),
        st.tuples(st.just("qsl"), st.integers(0, B), nonzero),
        st.tuples(st.just("pos"), t, st.sampled_from([-1, 1])),
        st.tuples(st.just("dtype"), st.sampled_from(FIELDS), st.sampled_from(range(len(DTYPES)))),
        st.tuples(st.just("drop"), st.sampled_from(FIELDS)),
        st.tuples(st.just("swap_rows"), b, b),
        st.tuples(st.just("skip_token"), t),  # a real token marked padding (slot -1)
        st.just(("none",)),
    ))
    return dict(reqs=reqs, padding=padding, shift=shift, order=order, mutation=mutation,
                seed=draw(st.integers(0, 2**16)))


def build(case: dict) -> AttentionMetadata:
    alloc = cp_compile.BlockAllocator(NUM_BLOCKS, VBS)
    alloc.ensure(-1, case["shift"])
    meta = cp_compile.build_attention_metadata(case["reqs"], alloc, req_ids=case["order"],
                                               num_padding_tokens=case["padding"], max_blocks_per_req=WIDTH)
    return mutate(meta, case["mutation"])


def mutate(meta: AttentionMetadata, m: tuple) -> AttentionMetadata:
    f = {name: getattr(meta, name).clone() for name in FIELDS}
    kind = m[0]
    if kind == "bt":
        f["block_table"][m[1], m[2]] = m[3]
    elif kind == "slot":
        f["slot_mapping"][m[1]] = m[2]
    elif kind == "slot_shift":
        f["slot_mapping"][m[1]] += m[2]
    elif kind == "seq":
        f["seq_lens"][m[1]] += m[2]
    elif kind == "qsl":
        f["query_start_loc"][m[1]] += m[2]
    elif kind == "pos":
        f["positions"][m[1]] += m[2]
    elif kind == "dtype":
        f[m[1]] = f[m[1]].to(DTYPES[m[2]])
    elif kind == "drop":
        f[m[1]] = f[m[1]][:, :-1] if m[1] == "block_table" else f[m[1]][:-1]
    elif kind == "swap_rows":
        f["block_table"][[m[1], m[2]]] = f["block_table"][[m[2], m[1]]]
    elif kind == "skip_token":
        f["slot_mapping"][m[1]] = -1
    return AttentionMetadata(**f)


def inputs(seed: int, T: int, hq: int = HQ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(T, hq, D, generator=g), torch.randn(T, HKV, D, generator=g),
            torch.randn(T, HKV, D, generator=g))


def single_caches(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (already 'cached') single-device K and V, assembled from the two DCP
    ranks' random shards so that the DCP runs start from the same cache."""
    shards = [rank_caches(seed, r) for r in range(2)]
    o = torch.arange(VBS)
    owner, local = o % 2, o // 2  # interleave 1: token j of a block lives on rank j % 2 at j // 2
    out = []
    for which in range(2):
        parts = torch.stack([shards[r][which] for r in range(2)])  # [2, NB, VBS/2, HKV, D]
        out.append(parts[owner, :, local].transpose(0, 1).contiguous())  # [NB, VBS, HKV, D]
    return out[0], out[1]


def rank_caches(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7 + rank)
    return (torch.randn(NUM_BLOCKS, VBS // 2, HKV, D, generator=g),
            torch.randn(NUM_BLOCKS, VBS // 2, HKV, D, generator=g))


def oracle(meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor,
           vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What valid metadata means, written independently of the ops: write every real
    token's k/v at its slot, then each token attends positions 0..pos of its request
    read through the block table (fp64, dense)."""
    kf, vf = kc.clone().flatten(0, 1), vc.clone().flatten(0, 1)
    qsl, seq, bt = meta.query_start_loc.tolist(), meta.seq_lens.tolist(), meta.block_table.long()
    for t, s in enumerate(meta.slot_mapping.tolist()):
        if s >= 0:
            kf[s], vf[s] = k[t], v[t]
    out = torch.zeros(q.shape[0], q.shape[1], D, dtype=torch.float64)
    group = q.shape[1] // HKV
    for b in range(len(seq)):
        ctx = seq[b] - (qsl[b + 1] - qsl[b])
        for t in range(qsl[b], qsl[b + 1]):
            p = ctx + t - qsl[b]
            j = torch.arange(p + 1)
            slots = bt[b, j // VBS] * VBS + j % VBS
            keys, vals = kf[slots].double(), vf[slots].double()  # [p+1, HKV, D]
            for h in range(q.shape[1]):
                w = torch.softmax(keys[:, h // group] @ q[t, h].double() * SCALE, 0)
                out[t, h] = w @ vals[:, h // group]
    return out, kf.view_as(kc), vf.view_as(vc)


def run_single(meta: AttentionMetadata, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor,
               vc: torch.Tensor) -> torch.Tensor | MetadataError:
    try:
        cp_compile.validate_step(meta, [(kc, vc)], cp=1, num_tokens=q.shape[0])
        return torch.ops.cp.gqa_paged_attention(q, k, v, kc, vc, meta.slot_mapping, meta.block_table,
                                                meta.seq_lens, meta.query_start_loc, SCALE)
    except MetadataError as e:
        return e


def check_refusal(e: MetadataError) -> None:
    msg = str(e)
    assert e.field in FIELDS + ("metadata",) and msg.startswith(e.field), msg
    assert "Fix:" in msg, msg
    if e.value is not None:
        assert str(e.value) in msg, msg
    if e.request is not None:
        assert f"(request {e.request})" in msg, msg


SINGLE = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow])


@SINGLE
@given(case=cases())
def test_fuzz_single_device(case):
    meta = build(case)
    T = sum(n for _, n in case["reqs"]) + case["padding"]
    q, k, v = inputs(case["seed"], T)
    kc, vc = single_caches(case["seed"])
    kc0, vc0 = kc.clone(), vc.clone()
    got = run_single(meta, q, k, v, kc, vc)
    if isinstance(got, MetadataError):
        check_refusal(got)
        assert torch.equal(kc, kc0) and torch.equal(vc, vc0), "a refused step wrote the cache"
        assert case["mutation"][0] != "none", got
        return
    want, k_want, v_want = oracle(meta, q, k, v, kc0, vc0)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kc, k_want) and torch.equal(vc, v_want)


def test_fuzz_catches_every_kind_of_mutation():
    """The fuzzer is not vacuous: each mutation kind that breaks the metadata is refused
    at least once, and unmutated cases are always accepted."""
    base = dict(reqs=[(5, 2), (0, 3)], padding=1, shift=3, order=[1, 0], seed=0)
    # (Dropping a block-table column is fine here: 5 columns, 2 used.)
    refused = {
        ("bt", 0, 1, NUM_BLOCKS): "block_table", ("slot", 0, NUM_BLOCKS * VBS): "slot_mapping",
        ("slot_shift", 3, 1): "slot_mapping", ("seq", 1, -1): "seq_lens", ("qsl", 1, 1): "slot_mapping",
        ("qsl", 2, 3): "query_start_loc", ("pos", 0, 1): "positions", ("dtype", "seq_lens", 0): "seq_lens",
        ("drop", "seq_lens"): "seq_lens", ("drop", "slot_mapping"): "slot_mapping",
        ("swap_rows", 0, 1): "slot_mapping", ("skip_token", 2): "slot_mapping",
        ("drop", "positions"): "positions",
        ("drop", "query_start_loc"): "seq_lens", ("qsl", 0, -1): "query_start_loc",
        ("qsl", 1, -3): "query_start_loc", ("dtype", "slot_mapping", 1): "slot_mapping",
        ("slot", 5, 3): "slot_mapping",  # padding token with a real slot
    }
    kc, vc = single_caches(0)
    q, k, v = inputs(0, 6)
    for m, field in refused.items():
        got = run_single(build(dict(base, mutation=m)), q, k, v, kc, vc)
        assert isinstance(got, MetadataError) and got.field == field, (m, got)
    assert isinstance(run_single(build(dict(base, mutation=("none",))), q, k, v, kc, vc), torch.Tensor)


# ---------------------------------------------------------------- 2 DCP ranks


def _dcp_cases(rank: int, world: int, cases_: list[dict]) -> list[tuple]:
    from cp_compile.ops.parallel import dcp as D

    cfg = cp_compile.CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=VBS // 2)
    state = cp_compile.init_parallel(cfg, device="cpu", timeout=30)
    ctx = D.DCPContext(group=state.layout.cp, interleave=1, block_size=VBS // 2)
    out = []
    for case in cases_:
        meta = build(case)
        T = sum(n for _, n in case["reqs"]) + case["padding"]
        q, k, v = inputs(case["seed"], T)
        q = q[:, rank * HQ // 2:(rank + 1) * HQ // 2]  # this TP rank's query heads
        kc, vc = rank_caches(case["seed"], rank)
        kc0, vc0 = kc.clone(), vc.clone()
        try:
            cp_compile.validate_step(meta, [(kc, vc)], num_tokens=T)  # cp from the parallel state
            o = D.dcp_gqa_attention(q, k, v, kc, vc, meta.slot_mapping, meta.block_table, meta.seq_lens,
                                    meta.query_start_loc, SCALE, ctx)
            out.append(("ok", o, kc, vc))
        except MetadataError as e:
            out.append(("refused", e.field, str(e), torch.equal(kc, kc0) and torch.equal(vc, vc0)))
    return out


def test_fuzz_two_dcp_ranks():
    collected: list[dict] = []

    @settings(max_examples=60, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow])
    @given(case=cases())
    def collect(case):
        collected.append(case)

    collect()
    res = run_on_ranks(_dcp_cases, 2, collected, timeout=300)
    verdicts = {"ok": 0, "refused": 0}
    for i, case in enumerate(collected):
        meta = build(case)
        T = sum(n for _, n in case["reqs"]) + case["padding"]
        q, k, v = inputs(case["seed"], T)
        kc, vc = single_caches(case["seed"])
        ref = run_single(meta, q, k, v, kc, vc)
        r0, r1 = res[0][i], res[1][i]
        if isinstance(ref, MetadataError):
            # Same verdict, same message, on every rank as on one device; nothing written.
            assert r0[0] == r1[0] == "refused", (case, ref, r0[:2], r1[:2])
            assert r0[1] == r1[1] == ref.field and r0[2] == r1[2], (r0[2], r1[2], str(ref))
            assert r0[3] and r1[3], "a refused DCP step wrote a rank's cache"
            verdicts["refused"] += 1
            continue
        assert r0[0] == r1[0] == "ok", (case, r0[:3], r1[:3])
        for rank, (_, o, kr, vr) in enumerate((r0, r1)):
            torch.testing.assert_close(o, ref[:, rank * HQ // 2:(rank + 1) * HQ // 2], atol=1e-5, rtol=1e-5)
            mine = torch.arange(VBS) % 2 == rank  # this rank's tokens of every block
            assert torch.equal(kr, kc[:, mine]) and torch.equal(vr, vc[:, mine])
        verdicts["ok"] += 1
    assert verdicts["ok"] >= 3 and verdicts["refused"] >= 10, verdicts
