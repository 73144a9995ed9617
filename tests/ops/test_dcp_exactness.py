"""DCP attention on real gloo ranks equals the single-device op, head for head.

Each case runs two steps through one set of caches: step A prefills the contexts,
step B is the case's batch (decode, chunked prefill, mixed, several query tokens
per request, sequences shorter than dcp, padding rows, virtual-block crossings).
The single-device reference runs in the test process on a cache with virtual
blocks of block_size * dcp; each rank runs the DCP composition on its shard with
its TP heads. All cases of a world run inside one spawned world (spawning is slow).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch

import cp_compile
import cp_compile.ops  # noqa: F401
from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel import dcp as D
from cp_compile.testing.batches import STEP_B, meta_args, two_step_metas
from cp_compile.testing.multirank import run_on_ranks

TP = 4
HQ = 8  # 2 query heads per TP rank
BLOCK = 4
NUM_BLOCKS = 16


@dataclass(frozen=True)
class Case:
    kind: str  # "gqa" | "mla"
    dcp: int
    interleave: int
    batch: str
    merge: str
    dtype: torch.dtype
    kv_heads: int = 1  # GQA only
    padding: int = 2


def _metas(case: Case):
    return two_step_metas(case.batch, dcp=case.dcp, block_size=BLOCK, num_blocks=NUM_BLOCKS, padding=case.padding)


def _inputs(case: Case, T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(case.dtype)  # noqa: E731
    if case.kind.startswith("gqa"):
        return dict(q=r(T, HQ, 16), k=r(T, case.kv_heads, 16), v=r(T, case.kv_heads, 12))
    return dict(q_nope=r(T, HQ, 16), q_pe=r(T, HQ, 8), kv_c=r(T, 16), k_pe=r(T, 8))


def _rank_heads(case: Case, tp_rank: int, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This TP rank's slice of the inputs: its query heads and its (replicated) KV head.
    Query replication (merge "replicate"): the query heads of its whole DCP group (a
    consecutive run of TP ranks), as the replicated query projection gives them."""
    hq = HQ // TP
    out = dict(x)
    if case.merge == "replicate":
        first = (tp_rank // case.dcp) * case.dcp  # the DCP group's first TP rank
        for name in ("q", "q_nope", "q_pe"):
            if name in x:
                out[name] = x[name][:, first * hq:(first + case.dcp) * hq]
        if case.kind.startswith("gqa"):
            kv = tp_rank // (TP // case.kv_heads)
            out["k"], out["v"] = x["k"][:, kv:kv + 1], x["v"][:, kv:kv + 1]
        return out
    if case.kind.startswith("gqa"):
        out["q"] = x["q"][:, tp_rank * hq:(tp_rank + 1) * hq]
        kv = tp_rank // (TP // case.kv_heads)
        out["k"], out["v"] = x["k"][:, kv:kv + 1], x["v"][:, kv:kv + 1]
    else:
        out["q_nope"] = x["q_nope"][:, tp_rank * hq:(tp_rank + 1) * hq]
        out["q_pe"] = x["q_pe"][:, tp_rank * hq:(tp_rank + 1) * hq]
    return out


def _caches(case: Case, block: int, kv_heads: int, dtype: torch.dtype):
    if case.kind.startswith("gqa"):
        return (torch.zeros(NUM_BLOCKS, block, kv_heads, 16, dtype=dtype),
                torch.zeros(NUM_BLOCKS, block, kv_heads, 12, dtype=dtype))
    return (torch.zeros(NUM_BLOCKS, block, 24, dtype=dtype),)


def _reference(case: Case) -> list[torch.Tensor]:
    """Single-device outputs of both steps, all heads."""
    caches = _caches(case, BLOCK * case.dcp, case.kv_heads, case.dtype)
    outs = []
    for step, meta in enumerate(_metas(case)):
        x = _inputs(case, meta.num_tokens, seed=step)
        if case.kind.startswith("gqa"):
            outs.append(torch.ops.cp.gqa_paged_attention(x["q"], x["k"], x["v"], *caches, *meta_args(meta), 0.25))
        else:
            outs.append(torch.ops.cp.mla_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], *caches,
                                                   *meta_args(meta), 0.2))
    return outs


def _run_cases(rank: int, world: int, cases: list[Case]) -> list[list[torch.Tensor]]:
    results = []
    for case in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=TP, decode_context_parallel_size=case.dcp,
                                  cp_kv_cache_interleave_size=case.interleave, block_size=BLOCK,
                                  dcp_merge=case.merge)
        state = cp_compile.init_parallel(cfg, device="cpu")
        ctx = CompileContext.from_state(state).cp_view()
        caches = _caches(case, BLOCK, 1, case.dtype)
        outs = []
        for step, meta in enumerate(_metas(case)):
            x = _rank_heads(case, state.layout.tp.rank, _inputs(case, meta.num_tokens, seed=step))
            if case.kind == "gqa":
                o = D.dcp_gqa_attention(x["q"], x["k"], x["v"], *caches, *meta_args(meta), 0.25, ctx)
            else:
                o = D.dcp_mla_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], *caches, *meta_args(meta),
                                        0.2, ctx)
            outs.append(o)
        results.append(outs)
        cp_compile.destroy_parallel()
    return results


def _check(cases: list[Case]) -> None:
    per_rank = run_on_ranks(_run_cases, TP, cases, timeout=600)
    worst: dict[str, float] = {}
    for i, case in enumerate(cases):
        ref = _reference(case)
        tol = 1e-5 if case.dtype == torch.float32 else 2e-2
        for step in range(2):
            got = torch.cat([per_rank[r][i][step] for r in range(TP)], dim=1)  # TP heads in rank order
            assert got.shape == ref[step].shape, (case, step)
            assert torch.isfinite(got).all(), (case, step)
            err = (got.float() - ref[step].float()).abs().max().item()
            worst[str(case)] = max(worst.get(str(case), 0.0), err)
            torch.testing.assert_close(got.float(), ref[step].float(), atol=tol, rtol=tol, msg=f"{case} step {step}")
    print("max abs error per case:", *(f"{k}: {v:.2e}" for k, v in worst.items()), sep="\n  ")


def _matrix(dcps, interleaves, kinds, merges, dtypes, batches):
    cases = []
    for dcp, inter, kind, merge, dtype, batch in itertools.product(dcps, interleaves, kinds, merges, dtypes, batches):
        kv = 1 if dcp == 4 else 2
        cases.append(Case(kind, dcp, inter, batch, merge, dtype, kv_heads=kv))
    return cases


def test_dcp_exact_on_four_ranks():
    """The CI matrix: dcp {2, 4} x interleave {1, 2, block} x GQA/MLA x AG+RS / A2A,
    mixed batches in fp32; decode and speculative decode in bf16; query replication at
    dcp {2, 4} x GQA/MLA, mixed fp32."""
    cases = _matrix([2, 4], [1, 2, BLOCK], ["gqa", "mla"], ["ag_rs", "a2a"], [torch.float32], ["mixed"])
    cases += _matrix([2, 4], [1], ["gqa", "mla"], ["ag_rs", "a2a"], [torch.bfloat16], ["decode", "spec_decode"])
    # Query replication (issue 26): the composition given the group's queries, no Q all-gather.
    cases += _matrix([2, 4], [BLOCK], ["gqa", "mla"], ["replicate"], [torch.float32], ["mixed"])
    _check(cases)


@pytest.mark.slow
def test_dcp_exact_wide_sweep():
    cases = _matrix([2, 4], [1, 2, BLOCK], ["gqa", "mla"], ["ag_rs", "a2a", "replicate"],
                    [torch.float32, torch.bfloat16], list(STEP_B))
    _check(cases)
