"""PCP attention on real gloo ranks equals the single-device op (docs/pcp.md).

Each case runs three steps on one set of caches:
A. PCP prefill of several requests of odd lengths, two shorter than 2*pcp, plus
   padding tokens;
B. PCP chunked prefill: requests with the prefix cached by A take more tokens, a new
   request joins;
C. a decode step through the existing DCP composition (`dcp_gqa_attention` /
   `dcp_mla_attention`) at N = pcp*dcp over a group of the pcp*dcp ranks, on the
   very cache tensors A and B wrote (no copy, no re-layout).
Every rank gets its head-tail token share (`pcp_token_table`) and its TP heads; the
outputs, put back in global order and head order, must equal the single-device op
on a cache with virtual blocks of block_size * pcp * dcp (fp32, 1e-5). Padding rows
of each rank's inputs hold 1e4, so a padding row that leaked into a result shows.
Step A (no request has cached context) also runs the fresh-step composition
(`PCPContext(fresh=True)`, no context part, issue 26): equal to the reference and to
the general composition's output.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist

import cp_compile
import cp_compile.ops  # noqa: F401
from cp_compile.passes.context import CompileContext
from cp_compile.ops.core import pcp_layout
from cp_compile.ops.parallel import dcp as D
from cp_compile.ops.parallel import pcp as P
from cp_compile.base.parallel_layout import Group
from cp_compile.testing.multirank import run_on_ranks

HQ = 4
BLOCK = 4
NUM_BLOCKS = 16
PAD = 1e4  # value of the padding rows of a rank's inputs
STEPS = [
    [(0, 1), (0, 3), (0, 7), (0, 12)],  # A: prefill; 1 and 3 < 2*pcp
    [(1, 5), (3, 2), (7, 1), (12, 9), (0, 5)],  # B: chunked prefill + a new request
    [(6, 1), (5, 1), (8, 1), (21, 1), (5, 1)],  # C: decode (DCP composition)
]
FRESH_STEPS = (0,)  # the steps without cached context: also run with PCPContext(fresh=True)


@dataclass(frozen=True)
class Case:
    kind: str  # "gqa" | "mla"
    tp: int
    dcp: int
    interleave: int
    pcp: int = 2
    padding: int = 2
    merge: str = "ag_rs"  # DCP head merge inside the context part (and the decode)
    dtype: torch.dtype = torch.float32


def _metas(case: Case):
    alloc = cp_compile.BlockAllocator(NUM_BLOCKS, BLOCK * case.pcp * case.dcp)
    return [cp_compile.build_attention_metadata(reqs, alloc, req_ids=list(range(len(reqs))),
                                                num_padding_tokens=case.padding, max_blocks_per_req=4)
            for reqs in STEPS]


def _inputs(case: Case, T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(case.dtype)  # noqa: E731
    if case.kind == "gqa":
        return dict(q=r(T, HQ, 16), k=r(T, 1, 16), v=r(T, 1, 12))
    return dict(q_nope=r(T, HQ, 16), q_pe=r(T, HQ, 8), kv_c=r(T, 16), k_pe=r(T, 8))


def _caches(case: Case, block: int):
    z = lambda *s: torch.zeros(*s, dtype=case.dtype)  # noqa: E731
    if case.kind == "gqa":
        return (z(NUM_BLOCKS, block, 1, 16), z(NUM_BLOCKS, block, 1, 12))
    return (z(NUM_BLOCKS, block, 24),)


def _meta_args(m):
    return (m.slot_mapping, m.block_table, m.seq_lens, m.query_start_loc)


def _reference(case: Case) -> list[torch.Tensor]:
    caches = _caches(case, BLOCK * case.pcp * case.dcp)
    outs = []
    for step, meta in enumerate(_metas(case)):
        x = _inputs(case, meta.num_tokens, seed=step)
        if case.kind == "gqa":
            outs.append(torch.ops.cp.gqa_paged_attention(x["q"], x["k"], x["v"], *caches, *_meta_args(meta), 0.25))
        else:
            outs.append(torch.ops.cp.mla_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], *caches,
                                                   *_meta_args(meta), 0.2))
    return outs


def _heads(x: dict[str, torch.Tensor], tp: int, tp_rank: int) -> dict[str, torch.Tensor]:
    h = HQ // tp
    return {k: (v[:, tp_rank * h:(tp_rank + 1) * h] if k in ("q", "q_nope", "q_pe") else v) for k, v in x.items()}


def _tokens(x: dict[str, torch.Tensor], row: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's token rows; padding rows (index -1) hold PAD."""
    keep = row >= 0
    out = {}
    for k, v in x.items():
        mine = v[row.clamp(min=0)]
        out[k] = torch.where(keep.view(-1, *[1] * (v.dim() - 1)), mine, torch.full_like(mine, PAD))
    return out


def _cp_group(case: Case, state) -> tuple[int, str]:
    """A group of the pcp*dcp ranks sharing this rank's KV shard set, ranks ascending
    (group rank == cp rank). Every rank creates every group, in the same order."""
    mine = None
    for d in range(case.tp // case.dcp):
        ranks = [g * case.tp + d * case.dcp + j for g in range(case.pcp) for j in range(case.dcp)]
        grp = dist.new_group(ranks)
        if state.rank in ranks:
            mine = (ranks.index(state.rank), grp)
    assert mine is not None
    return mine[0], mine[1].group_name


def _run(rank: int, world: int, cases: list[Case]):
    results = []
    for case in cases:
        if case.tp * case.pcp != world:
            results.append(None)
            continue
        cfg = cp_compile.CPConfig(tensor_parallel_size=case.tp, decode_context_parallel_size=case.dcp,
                                  prefill_context_parallel_size=case.pcp,
                                  cp_kv_cache_interleave_size=case.interleave, block_size=BLOCK,
                                  dcp_merge=case.merge)
        state = cp_compile.init_parallel(cfg, device="cpu")
        pctx = CompileContext.from_state(state).pcp_view()
        cp_rank, cp_name = _cp_group(case, state)
        assert cp_rank == pctx.cp.rank
        caches = _caches(case, BLOCK)
        ptrs = [c.data_ptr() for c in caches]
        outs = []
        for step, meta in enumerate(_metas(case)):
            x = _heads(_inputs(case, meta.num_tokens, seed=step), case.tp, state.layout.tp.rank)
            if step < 2:  # PCP prefill steps
                rows = pcp_layout.pcp_token_table(meta.query_start_loc, meta.num_tokens, pcp=case.pcp)
                row = rows[state.layout.pcp.rank]
                xs = _tokens(x, row)
                # The fresh composition rewrites the same K/V at the same slots (the cache is unchanged).
                o, o_fresh = [_pcp_prefill(case, xs, caches, meta, row, c)
                              for c in (pctx, replace(pctx, fresh=True) if step in FRESH_STEPS else None)]
                outs.append((row, o, o_fresh))
            else:  # decode on the same cache through the DCP composition at N = pcp*dcp
                dctx = D.DCPContext(group=Group(pctx.cp.size, cp_rank, cp_name), interleave=case.interleave,
                                    block_size=BLOCK, merge=case.merge)
                if case.kind == "gqa":
                    o = D.dcp_gqa_attention(x["q"], x["k"], x["v"], *caches, *_meta_args(meta), 0.25, dctx)
                else:
                    o = D.dcp_mla_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], *caches,
                                            *_meta_args(meta), 0.2, dctx)
                outs.append((None, o, None))
        assert [c.data_ptr() for c in caches] == ptrs  # the decode read the tensors the prefill wrote
        results.append(dict(outs=outs, tp_rank=state.layout.tp.rank, pcp_rank=state.layout.pcp.rank))
        cp_compile.destroy_parallel()
    return results


def _pcp_prefill(case: Case, xs: dict[str, torch.Tensor], caches, meta, row: torch.Tensor,
                 pctx: P.PCPContext | None) -> torch.Tensor | None:
    """The PCP composition on this rank's tokens ([T_loc, H, Dv]); None without a context."""
    if pctx is None:
        return None
    if case.kind == "gqa":
        return P.pcp_gqa_attention(xs["q"], xs["k"], xs["v"], *caches, *_meta_args(meta), row, 0.25, pctx)
    return P.pcp_mla_attention(xs["q_nope"], xs["q_pe"], xs["kv_c"], xs["k_pe"], *caches, *_meta_args(meta), row,
                               0.2, pctx)


def _assemble(per_rank: list, i: int, case: Case, step: int, which: int, want: torch.Tensor,
              tol: float) -> torch.Tensor:
    """Output `which` (1: the general composition, 2: the fresh one) of `step`, every rank's
    rows and heads put back in global token and head order ([T, HQ, Dv])."""
    h = HQ // case.tp
    got = torch.full_like(want, float("nan"))
    for r, outs in enumerate(per_rank):
        res = outs[i]
        row, o = res["outs"][step][0], res["outs"][step][which]
        heads = slice(res["tp_rank"] * h, (res["tp_rank"] + 1) * h)
        if row is None:  # decode: every rank all tokens, its heads (PCP peers agree)
            if res["pcp_rank"] == 0:
                got[:, heads] = o
            else:
                torch.testing.assert_close(o, got[:, heads], atol=tol, rtol=tol)
            continue
        keep = row >= 0
        assert bool((o[~keep] == 0).all()), (case, step, r)  # padding rows are zeros
        got[row[keep], heads] = o[keep]
    # Global padding tokens belong to no rank; the single-device op gives zeros there.
    n_real = int(_metas(case)[step].query_start_loc[-1])
    if step < 2:
        assert bool(torch.isnan(got[n_real:]).all())
        got[n_real:] = 0
    assert torch.isfinite(got).all(), (case, step)
    return got


def _check(world: int, cases: list[Case]) -> dict[str, list[float]]:
    per_rank = run_on_ranks(_run, world, cases, timeout=300)
    errs = {}
    for i, case in enumerate(cases):
        if case.tp * case.pcp != world:
            continue
        ref = _reference(case)
        tol = 1e-5 if case.dtype == torch.float32 else 2e-2
        errs[str(case)] = []
        for step in range(3):
            want = ref[step]
            got = _assemble(per_rank, i, case, step, 1, want, tol)
            errs[str(case)].append((got.float() - want.float()).abs().max().item())
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=f"{case} step {step}")
            if step in FRESH_STEPS:  # the fresh composition: the same output without the context part
                fresh = _assemble(per_rank, i, case, step, 2, want, tol)
                errs[str(case)].append((fresh.float() - want.float()).abs().max().item())
                torch.testing.assert_close(fresh.float(), want.float(), atol=tol, rtol=tol,
                                           msg=f"{case} step {step}, fresh composition vs one device")
                torch.testing.assert_close(fresh.float(), got.float(), atol=tol, rtol=tol,
                                           msg=f"{case} step {step}, fresh vs general composition")
    print(f"max abs error (prefill, its fresh composition at steps {FRESH_STEPS}, chunked prefill, decode):",
          *(f"{k}: {', '.join(f'{e:.1e}' for e in v)}" for k, v in errs.items()), sep="\n  ")
    return errs


def test_pcp_exact_two_ranks():
    """pcp = 2, tp = 1 (world 2): GQA and MLA, interleave 1 and block."""
    cases = [Case(k, 1, 1, i) for k in ("gqa", "mla") for i in (1, BLOCK)]
    assert len(_check(2, cases)) == len(cases)


def test_pcp_exact_four_ranks():
    """pcp = 2, tp = 2, dcp = 2 (world 4, cache over 4 ranks); dcp = 1 at tp = 2 is in the slow sweep."""
    cases = [Case("gqa", 2, 2, 1), Case("mla", 2, 2, BLOCK)]
    assert len(_check(4, cases)) == len(cases)


@pytest.mark.slow
def test_pcp_exact_four_ranks_wide():
    cases = [Case(k, 2, d, i) for k in ("gqa", "mla") for d in (1, 2) for i in (1, 2, BLOCK)]
    cases += [Case(k, 2, 2, 1, merge="a2a") for k in ("gqa", "mla")]
    cases += [Case(k, 2, 2, 1, dtype=torch.bfloat16) for k in ("gqa", "mla")]
    assert len(_check(4, cases)) == len(cases)
