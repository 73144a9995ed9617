"""DCP over a quantised KV cache (issue 39) on real gloo ranks equals one device with the same
quantised cache: the same cache bytes and scales on each token's owner rank, the same outputs.

World: tp 2 = dcp 2 (one KV head shared by the group), two steps through one set of caches
(contexts, then a mixed batch of prefill, chunked prefill and decode; cp_compile.testing.batches).
The single-device reference runs in the test process on caches with virtual blocks of
block_size * dcp tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import cp_compile
import cp_compile.ops  # noqa: F401
from cp_compile.ops.parallel import dcp as D
from cp_compile.passes.context import CompileContext
from cp_compile.testing.batches import meta_args, two_step_metas
from cp_compile.testing.multirank import run_on_ranks

TP = DCP = 2
HQ = 4  # 2 query heads per rank
BLOCK, NUM_BLOCKS = 4, 16
PAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Case:
    kind: str  # "gqa" | "mla"
    kv_dtype: str  # CPConfig.kv_cache_dtype
    dtype: torch.dtype  # the model's
    interleave: int
    batch: str = "mixed"
    merge: str = "ag_rs"


CASES = [Case("gqa", "int8", torch.float32, 1), Case("mla", "fp8_e4m3", torch.float32, BLOCK, merge="a2a")]
WIDE = [Case("gqa", "fp8_e4m3", torch.bfloat16, BLOCK, batch="decode", merge="a2a"),
        Case("mla", "int8", torch.float32, 1), Case("mla", "int8", torch.bfloat16, 2, batch="spec_decode"),
        Case("gqa", "int8", torch.float32, 2, batch="spec_decode", merge="a2a")]


def _inputs(case: Case, T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(case.dtype)  # noqa: E731
    if case.kind == "gqa":
        return dict(q=r(T, HQ, 16), k=r(T, 1, 16), v=r(T, 1, 8))
    return dict(q_nope=r(T, HQ, 16), q_pe=r(T, HQ, 8), kv_c=r(T, 16), k_pe=r(T, 8))


def _caches(case: Case, block: int) -> tuple[torch.Tensor, ...]:
    dt = PAGE[case.kv_dtype]
    if case.kind == "gqa":
        return (torch.zeros(NUM_BLOCKS, block, 1, 16, dtype=dt), torch.zeros(NUM_BLOCKS, block, 1, 8, dtype=dt),
                torch.zeros(NUM_BLOCKS, block, 1), torch.zeros(NUM_BLOCKS, block, 1))
    return torch.zeros(NUM_BLOCKS, block, 24, dtype=dt), torch.zeros(NUM_BLOCKS, block, 1)


def _step(case: Case, x: dict[str, torch.Tensor], caches, meta, ctx=None) -> torch.Tensor:
    if case.kind == "gqa":
        k_cache, v_cache, ks, vs = caches
        if ctx is None:
            return torch.ops.cp.gqa_paged_attention_quant(x["q"], x["k"], x["v"], k_cache, v_cache, ks, vs,
                                                          *meta_args(meta), 0.25)
        return D.dcp_gqa_attention(x["q"], x["k"], x["v"], k_cache, v_cache, *meta_args(meta), 0.25, ctx,
                                   k_scale_cache=ks, v_scale_cache=vs)
    kv, s = caches
    if ctx is None:
        return torch.ops.cp.mla_attention_quant(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], kv, s, *meta_args(meta),
                                                0.2)
    return D.dcp_mla_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], kv, *meta_args(meta), 0.2, ctx,
                               kv_scale_cache=s)


def _run_cases(rank: int, world: int, cases: list[Case]):
    results = []
    for case in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=TP, decode_context_parallel_size=DCP, block_size=BLOCK,
                                  cp_kv_cache_interleave_size=case.interleave, dcp_merge=case.merge,
                                  kv_cache_dtype=case.kv_dtype)
        state = cp_compile.init_parallel(cfg, device="cpu")
        ctx = CompileContext.from_state(state).cp_view()
        caches = _caches(case, BLOCK)
        hq = slice(rank * HQ // TP, (rank + 1) * HQ // TP)
        outs = []
        for step, meta in enumerate(two_step_metas(case.batch, dcp=DCP, block_size=BLOCK, num_blocks=NUM_BLOCKS)):
            x = _inputs(case, meta.num_tokens, seed=step)
            x = {k: (v[:, hq] if k in ("q", "q_nope", "q_pe") else v) for k, v in x.items()}  # this rank's heads
            outs.append(_step(case, x, caches, meta, ctx))
        results.append((outs, caches))
        cp_compile.destroy_parallel()
    return results


def _owner_view(single: torch.Tensor, shards: list[torch.Tensor], interleave: int) -> list[tuple[torch.Tensor, ...]]:
    """(single-device rows, the owner rank's rows) per rank: virtual offset o of a block lives on
    rank (o // I) % N at local offset (o // (N * I)) * I + o % I (docs/architecture.md §5)."""
    pairs = []
    o = torch.arange(BLOCK * DCP)
    owner = (o // interleave) % DCP
    local = (o // (DCP * interleave)) * interleave + o % interleave
    for r in range(DCP):
        mine = owner == r
        pairs.append((single[:, o[mine]], shards[r][:, local[mine]]))
    return pairs


def test_quantised_dcp2_matches_one_device_with_the_same_quantised_cache():
    """GQA and MLA, int8 and fp8, fp32 and bf16 models, interleave 1 / 2 / block, both merges,
    mixed, decode and spec-decode batches: one spawned world (its start is most of the time)."""
    _check(CASES + WIDE)


def _check(cases: list[Case]) -> None:
    per_rank = run_on_ranks(_run_cases, TP, cases, timeout=600)
    for i, case in enumerate(cases):
        ref_caches = _caches(case, BLOCK * DCP)
        tol = 1e-5 if case.dtype == torch.float32 else 2e-2
        for step, meta in enumerate(two_step_metas(case.batch, dcp=DCP, block_size=BLOCK, num_blocks=NUM_BLOCKS)):
            want = _step(case, _inputs(case, meta.num_tokens, seed=step), ref_caches, meta)
            got = torch.cat([per_rank[r][i][0][step] for r in range(TP)], dim=1)  # heads in rank order
            assert torch.isfinite(got.float()).all(), case
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=f"{case} step {step}")
        # The owner rank holds the single device's bytes of each token, scales included.
        n = len(ref_caches) // 2
        for j, single in enumerate(ref_caches):
            for want_rows, got_rows in _owner_view(single, [per_rank[r][i][1][j] for r in range(TP)], case.interleave):
                if j < n:  # codes: the same write of the same inputs on the owner
                    assert torch.equal(got_rows.view(torch.uint8), want_rows.view(torch.uint8)), (case, j)
                else:
                    torch.testing.assert_close(got_rows, want_rows, atol=0, rtol=1e-6, msg=f"{case} scales")
        assert ref_caches[n].abs().sum() > 0  # something was written and compared
