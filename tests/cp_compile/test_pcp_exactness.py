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
    kv_dtype: str = "auto"  # CPConfig.kv_cache_dtype: "int8" / "fp8_e4m3" pages with their scales (issue 39)


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


PAGE = {"auto": None, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _caches(case: Case, block: int):
    """(k, v) / (latent,); a quantised cache: (k, v, k_scale, v_scale) / (latent, latent_scale)."""
    dt = PAGE[case.kv_dtype] or case.dtype
    z = lambda *s: torch.zeros(*s, dtype=dt)  # noqa: E731
    sc = lambda *s: torch.zeros(*s) if case.kv_dtype != "auto" else None  # noqa: E731
    if case.kind == "gqa":
        out = (z(NUM_BLOCKS, block, 1, 16), z(NUM_BLOCKS, block, 1, 12), sc(NUM_BLOCKS, block, 1),
               sc(NUM_BLOCKS, block, 1))
    else:
        out = (z(NUM_BLOCKS, block, 24), sc(NUM_BLOCKS, block, 1))
    return tuple(t for t in out if t is not None)


def _pages(caches) -> tuple:
    """The page tensors of `_caches` (the first half of a quantised cache's tuple)."""
    return caches[: len(caches) // 2] if caches[-1].dtype == torch.float32 and caches[0].dtype in \
        (torch.int8, torch.float8_e4m3fn) else caches


def _scales(case: Case, caches) -> dict:
    """The scale caches as the compositions' keyword arguments ({} for "auto")."""
    if case.kv_dtype == "auto":
        return {}
    if case.kind == "gqa":
        return dict(k_scale_cache=caches[2], v_scale_cache=caches[3])
    return dict(kv_scale_cache=caches[1])


def _meta_args(m):
    return (m.slot_mapping, m.block_table, m.seq_lens, m.query_start_loc)


def _reference(case: Case, keep: list | None = None) -> list[torch.Tensor]:
    """The single-device outputs per step; `keep`: gets the single device's caches."""
    caches = _caches(case, BLOCK * case.pcp * case.dcp)
    if keep is not None:
        keep.append(caches)
    outs = []
    for step, meta in enumerate(_metas(case)):
        x = _inputs(case, meta.num_tokens, seed=step)
        quant = case.kv_dtype != "auto"  # the quantised ops take the scale caches after the pages
        if case.kind == "gqa":
            op = torch.ops.cp.gqa_paged_attention_quant if quant else torch.ops.cp.gqa_paged_attention
            outs.append(op(x["q"], x["k"], x["v"], *caches, *_meta_args(meta), 0.25))
        else:
            op = torch.ops.cp.mla_attention_quant if quant else torch.ops.cp.mla_attention
            outs.append(op(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], *caches, *_meta_args(meta), 0.2))
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
                                  dcp_merge=case.merge, kv_cache_dtype=case.kv_dtype)
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
                    o = D.dcp_gqa_attention(x["q"], x["k"], x["v"], *_pages(caches), *_meta_args(meta), 0.25, dctx,
                                            **_scales(case, caches))
                else:
                    o = D.dcp_mla_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], *_pages(caches),
                                            *_meta_args(meta), 0.2, dctx, **_scales(case, caches))
                outs.append((None, o, None))
        assert [c.data_ptr() for c in caches] == ptrs  # the decode read the tensors the prefill wrote
        results.append(dict(outs=outs, tp_rank=state.layout.tp.rank, pcp_rank=state.layout.pcp.rank,
                            caches=caches, cp_rank=cp_rank))
        cp_compile.destroy_parallel()
    return results


def _pcp_prefill(case: Case, xs: dict[str, torch.Tensor], caches, meta, row: torch.Tensor,
                 pctx: P.PCPContext | None) -> torch.Tensor | None:
    """The PCP composition on this rank's tokens ([T_loc, H, Dv]); None without a context."""
    if pctx is None:
        return None
    if case.kind == "gqa":
        return P.pcp_gqa_attention(xs["q"], xs["k"], xs["v"], *_pages(caches), *_meta_args(meta), row, 0.25, pctx,
                                   **_scales(case, caches))
    return P.pcp_mla_attention(xs["q_nope"], xs["q_pe"], xs["kv_c"], xs["k_pe"], *_pages(caches), *_meta_args(meta),
                               row, 0.2, pctx, **_scales(case, caches))


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
        ref_caches: list = []
        ref = _reference(case, ref_caches)
        if case.kv_dtype != "auto":
            _check_owner_bytes(case, ref_caches[0], [outs[i] for outs in per_rank])
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


def _check_owner_bytes(case: Case, single: tuple, results: list[dict]) -> None:
    """A quantised cache: each token's codes (byte-equal) and scale sit on its owner cp rank
    as the single device stores them (virtual offset o of a block of BLOCK * N lives on cp
    rank (o // I) % N at local offset (o // (N * I)) * I + o % I, docs/architecture.md §5)."""
    N, I = case.pcp * case.dcp, case.interleave
    o = torch.arange(BLOCK * N)
    owner, local = (o // I) % N, (o // (N * I)) * I + o % I
    by_cp = {res["cp_rank"]: res["caches"] for res in results}
    n = len(single) // 2
    for j, want in enumerate(single):
        for r in range(N):
            mine = owner == r
            w, g = want[:, o[mine]], by_cp[r][j][:, local[mine]]
            if j < n:
                assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (case, j, r)
            else:
                torch.testing.assert_close(g, w, atol=0, rtol=1e-6, msg=f"{case} scales, cp rank {r}")
    assert single[n].abs().sum() > 0  # something was written and compared


def test_pcp_exact_two_ranks():
    """pcp = 2, tp = 1 (world 2): GQA and MLA, interleave 1 and block."""
    cases = [Case(k, 1, 1, i) for k in ("gqa", "mla") for i in (1, BLOCK)]
    assert len(_check(2, cases)) == len(cases)


def test_pcp_exact_four_ranks():
    """pcp = 2, tp = 2, dcp = 2 (world 4, cache over 4 ranks); dcp = 1 at tp = 2 is in the slow sweep."""
    cases = [Case("gqa", 2, 2, 1), Case("mla", 2, 2, BLOCK)]
    assert len(_check(4, cases)) == len(cases)


def test_pcp_quantised_cache_exact_two_ranks():
    """A quantised KV cache (issue 39, decision 68): pcp = 2, GQA int8 and MLA fp8 (interleave 1
    and block): prefill, chunked prefill and the DCP decode on the same cache equal one device
    with the same quantised cache, and each token's codes and scale sit on its owner rank."""
    cases = [Case("gqa", 1, 1, 1, kv_dtype="int8"), Case("mla", 1, 1, BLOCK, kv_dtype="fp8_e4m3")]
    assert len(_check(2, cases)) == len(cases)


@pytest.mark.slow
def test_pcp_quantised_cache_exact_four_ranks():
    cases = [Case("gqa", 2, 2, 1, kv_dtype="fp8_e4m3"), Case("mla", 2, 2, BLOCK, kv_dtype="int8"),
             Case("gqa", 2, 1, 2, kv_dtype="int8", dtype=torch.bfloat16),
             Case("mla", 2, 2, 1, kv_dtype="fp8_e4m3", merge="a2a", dtype=torch.bfloat16)]
    assert len(_check(4, cases)) == len(cases)


@pytest.mark.slow
def test_pcp_exact_four_ranks_wide():
    cases = [Case(k, 2, d, i) for k in ("gqa", "mla") for d in (1, 2) for i in (1, 2, BLOCK)]
    cases += [Case(k, 2, 2, 1, merge="a2a") for k in ("gqa", "mla")]
    cases += [Case(k, 2, 2, 1, dtype=torch.bfloat16) for k in ("gqa", "mla")]
    assert len(_check(4, cases)) == len(cases)
