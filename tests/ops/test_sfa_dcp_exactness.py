"""SFA DCP (replicated indexer) on real gloo ranks equals the single-device ops.

Each case runs two steps through one set of caches (step A prefills the contexts,
step B is the case's batch). The single-device reference runs the lightning indexer
and sparse MLA in the test process on caches with virtual blocks of
`block_size * dcp`. Each rank (tp = dcp) runs the indexer on its replicated cache
(same layout as the reference's) and `dcp_sfa_attention` on its latent shard with
its TP heads. Checked: the top-k index sets are identical to the single-device ones
(ties and -1 padding included), and the attention output equals the reference.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

import cp_compile
from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel import dcp as D
from cp_compile.testing.batches import STEP_B, meta_args, two_step_metas
from cp_compile.testing.multirank import run_on_ranks

H = 8  # query heads in all
L, R = 16, 8  # latent, rope dims
HI, DI = 2, 8  # indexer heads, indexer key dim
TOPK = 6
BLOCK = 4
NUM_BLOCKS = 16
SCALE = 0.2


@dataclass(frozen=True)
class Case:
    dcp: int
    interleave: int
    batch: str
    merge: str
    dtype: torch.dtype
    padding: int = 2


def _metas(case: Case):
    return two_step_metas(case.batch, dcp=case.dcp, block_size=BLOCK, num_blocks=NUM_BLOCKS, padding=case.padding)


def _inputs(case: Case, T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(case.dtype)  # noqa: E731
    k_i = torch.randn(T, DI, generator=g)
    k_i[1::3] = k_i[0::3][: k_i[1::3].shape[0]]  # equal keys -> equal scores: ties must break the same way
    return dict(q_nope=r(T, H, L), q_pe=r(T, H, R), kv_c=r(T, L), k_pe=r(T, R),
                q_i=torch.randn(T, HI, DI, generator=g), k_i=k_i, w=torch.rand(T, HI, generator=g))


def _index_cache(case: Case) -> torch.Tensor:
    # Replicated: virtual blocks of BLOCK * dcp tokens on every rank, as on one device.
    return torch.zeros(NUM_BLOCKS, BLOCK * case.dcp, DI)


def _topk(x, index_cache, meta) -> torch.Tensor:
    return torch.ops.cp.lightning_indexer(x["q_i"], x["k_i"], x["w"], index_cache, *meta_args(meta), TOPK)


def _reference(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Single-device (top-k, output) of both steps, all heads."""
    latent = torch.zeros(NUM_BLOCKS, BLOCK * case.dcp, L + R, dtype=case.dtype)
    index_cache = _index_cache(case)
    outs = []
    for step, meta in enumerate(_metas(case)):
        x = _inputs(case, meta.num_tokens, seed=step)
        topk = _topk(x, index_cache, meta)
        o = torch.ops.cp.sparse_mla_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], latent,
                                              *meta_args(meta), topk, SCALE)
        outs.append((topk, o))
    return outs


def _run_cases(rank: int, world: int, cases: list[Case]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    results = []
    for case in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=case.dcp,
                                  cp_kv_cache_interleave_size=case.interleave, block_size=BLOCK,
                                  dcp_merge=case.merge)
        state = cp_compile.init_parallel(cfg, device="cpu")
        ctx = CompileContext.from_state(state).cp_view()
        latent = torch.zeros(NUM_BLOCKS, BLOCK, L + R, dtype=case.dtype)  # this rank's shard
        index_cache = _index_cache(case)
        hl = H // world
        heads = slice(state.layout.tp.rank * hl, (state.layout.tp.rank + 1) * hl)
        outs = []
        for step, meta in enumerate(_metas(case)):
            x = _inputs(case, meta.num_tokens, seed=step)
            topk = _topk(x, index_cache, meta)
            o = D.dcp_sfa_attention(x["q_nope"][:, heads], x["q_pe"][:, heads], x["kv_c"], x["k_pe"], latent,
                                    *meta_args(meta), topk, SCALE, ctx)
            outs.append((topk, o))
        results.append(outs)
        cp_compile.destroy_parallel()
    return results


def _check(cases: list[Case], world: int) -> dict[str, float]:
    per_rank = run_on_ranks(_run_cases, world, cases, timeout=600)
    worst: dict[str, float] = {}
    for i, case in enumerate(cases):
        ref = _reference(case)
        tol = 1e-5 if case.dtype == torch.float32 else 2e-2
        for step in range(2):
            ref_topk, ref_out = ref[step]
            assert (ref_topk == -1).any() and (ref_topk >= 0).any(), "the case must exercise -1 padding"
            for r in range(world):
                assert torch.equal(per_rank[r][i][step][0], ref_topk), (case, step, r)
            got = torch.cat([per_rank[r][i][step][1] for r in range(world)], dim=1)  # TP heads in rank order
            assert got.shape == ref_out.shape and torch.isfinite(got).all(), (case, step)
            worst[str(case)] = max(worst.get(str(case), 0.0), (got.float() - ref_out.float()).abs().max().item())
            torch.testing.assert_close(got.float(), ref_out.float(), atol=tol, rtol=tol, msg=f"{case} step {step}")
    return worst


def _matrix(dcp, interleaves, batches, merges, dtypes) -> list[Case]:
    return [Case(dcp, i, b, m, d) for i, b, m, d in itertools.product(interleaves, batches, merges, dtypes)]


def test_sfa_dcp_exact_on_two_ranks(summary_note):
    """tp = dcp = 2: interleave {1, 2, block} x decode / mixed / speculative decode x
    both merges in fp32, decode in bf16."""
    cases = _matrix(2, [1, 2, BLOCK], list(STEP_B), ["ag_rs", "a2a"], [torch.float32])
    cases += _matrix(2, [1], ["decode"], ["ag_rs"], [torch.bfloat16])
    worst = _check(cases, 2)
    by_dtype = {d: max(v for k, v in worst.items() if d in k) for d in ("float32", "bfloat16")}
    summary_note(f"SFA DCP exactness (tp = dcp = 2, {len(cases)} cases x 2 steps): max |out diff| "
                 f"fp32 {by_dtype['float32']:.1e}, bf16 {by_dtype['bfloat16']:.1e}; "
                 f"top-k identical to single device in every case")


@pytest.mark.slow
def test_sfa_dcp_exact_on_four_ranks():
    _check(_matrix(4, [1, 2, BLOCK], list(STEP_B), ["ag_rs", "a2a"], [torch.float32, torch.bfloat16]), 4)


def test_sparse_indices_op():
    """opcheck, and the remap of a known row: dcp 2, interleave 2, block 4."""
    idx = torch.tensor([[0, 2, 1, 3, 4, 6, -1, 5]], dtype=torch.int32)
    # positions 0,1 | 4,5 on rank 0 (local 0,1,2,3); 2,3 | 6 on rank 1 (local 0,1,2)
    r0 = torch.ops.cp.dcp_sparse_indices(idx, 2, 0, 2, 4)
    r1 = torch.ops.cp.dcp_sparse_indices(idx, 2, 1, 2, 4)
    assert r0.tolist() == [[0, 1, 2, 3, -1, -1, -1, -1]]
    assert r1.tolist() == [[0, 1, 2, -1, -1, -1, -1, -1]]
    torch.library.opcheck(torch.ops.cp.dcp_sparse_indices, (idx, 2, 1, 2, 4))


def test_sparse_partial_attention_op():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(4, 4, L + R, generator=g)
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    idx = torch.tensor([[0, 5, -1], [-1, -1, -1], [1, 2, 7]], dtype=torch.int32)
    args = (torch.randn(3, 2, L, generator=g), torch.randn(3, 2, R, generator=g), cache, bt, qsl, idx, 0.3)
    out, lse = torch.ops.cp.sparse_mla_partial_attention(*args)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isinf(lse[1]).all()  # no keys: 0, -inf
    torch.library.opcheck(torch.ops.cp.sparse_mla_partial_attention, args)
