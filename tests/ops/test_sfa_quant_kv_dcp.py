"""SFA (sparse MLA with a lightning indexer) over a quantised latent cache (issue 39, decision 69).

In process: the quantised op equals the model-dtype op run on the dequantised cache (the write
quantises, the read dequantises on load, nothing else changes), the indexer's cache stays in the
model's dtype, refusals before anything is written, opcheck.

On real gloo ranks, tp = dcp = 2: the lightning indexer on its replicated cache, then
`dcp_sfa_attention` over each rank's quantised latent shard, equals one device with the same
quantised cache (virtual blocks of block_size * dcp tokens): outputs within fp32 1e-5 / bf16
2e-2, top-k identical, and each token's codes (byte-equal) and scale on its owner rank equal
the single device's. Two steps through one set of caches (contexts, then the case's batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

import cp_compile
import cp_compile.ops  # noqa: F401
from cp_compile.ops.core import kv_quant
from cp_compile.ops.parallel import dcp as D
from cp_compile.passes.context import CompileContext
from cp_compile.runtime.kv_cache import KVCacheSpec, allocate_kv_cache
from cp_compile.serving.kv_transfer.layout import KVGeometry
from cp_compile.testing.batches import meta_args, two_step_metas
from cp_compile.testing.multirank import run_on_ranks

TP = DCP = 2
H = 4  # query heads in all, 2 per rank
L, R = 16, 8  # latent, rope dims
HI, DI = 2, 8  # indexer heads, indexer key dim
TOPK = 6
BLOCK, NUM_BLOCKS = 4, 16
SCALE = 0.2
PAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


@dataclass(frozen=True)
class Case:
    kv_dtype: str  # CPConfig.kv_cache_dtype
    dtype: torch.dtype  # the model's
    interleave: int
    batch: str = "mixed"
    merge: str = "ag_rs"


CASES = [Case("int8", torch.float32, 1), Case("fp8_e4m3", torch.float32, BLOCK, merge="a2a"),
         Case("int8", torch.bfloat16, 2, batch="decode"), Case("fp8_e4m3", torch.bfloat16, 1, batch="spec_decode")]


def _inputs(case: Case, T: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(case.dtype)  # noqa: E731
    return dict(q_nope=r(T, H, L), q_pe=r(T, H, R), kv_c=r(T, L) * 3, k_pe=r(T, R),
                q_i=torch.randn(T, HI, DI, generator=g), k_i=torch.randn(T, DI, generator=g),
                w=torch.rand(T, HI, generator=g))


def _caches(case: Case, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(latent codes, latent scales, indexer keys): the indexer's are replicated, virtual blocks
    of BLOCK * dcp tokens on every rank, in the model's dtype (not quantised)."""
    return (torch.zeros(NUM_BLOCKS, block, L + R, dtype=PAGE[case.kv_dtype]), torch.zeros(NUM_BLOCKS, block, 1),
            torch.zeros(NUM_BLOCKS, BLOCK * DCP, DI))


def _step(x, caches, meta, ctx=None):
    latent, scales, index_cache = caches
    topk = torch.ops.cp.lightning_indexer(x["q_i"], x["k_i"], x["w"], index_cache, *meta_args(meta), TOPK)
    if ctx is None:
        out = torch.ops.cp.sparse_mla_attention_quant(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], latent, scales,
                                                      *meta_args(meta), topk, SCALE)
    else:
        out = D.dcp_sfa_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], latent, *meta_args(meta), topk,
                                  SCALE, ctx, kv_scale_cache=scales)
    return topk, out


def _run_cases(rank: int, world: int, cases: list[Case]):
    results = []
    for case in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=TP, decode_context_parallel_size=DCP, block_size=BLOCK,
                                  cp_kv_cache_interleave_size=case.interleave, dcp_merge=case.merge,
                                  kv_cache_dtype=case.kv_dtype)
        state = cp_compile.init_parallel(cfg, device="cpu")
        ctx = CompileContext.from_state(state).cp_view()
        caches = _caches(case, BLOCK)  # this rank's latent shard and scales, the replicated indexer keys
        heads = slice(rank * H // TP, (rank + 1) * H // TP)
        outs = []
        for step, meta in enumerate(two_step_metas(case.batch, dcp=DCP, block_size=BLOCK, num_blocks=NUM_BLOCKS)):
            x = _inputs(case, meta.num_tokens, seed=step)
            x = {k: (v[:, heads] if k in ("q_nope", "q_pe") else v) for k, v in x.items()}  # this rank's heads
            outs.append(_step(x, caches, meta, ctx))
        results.append((outs, caches[:2]))
        cp_compile.destroy_parallel()
    return results


def _owner_view(single: torch.Tensor, shards: list[torch.Tensor], interleave: int):
    """(single-device rows, the owner rank's rows) per rank: virtual offset o of a block lives on
    rank (o // I) % N at local offset (o // (N * I)) * I + o % I (docs/architecture.md §5)."""
    o = torch.arange(BLOCK * DCP)
    owner = (o // interleave) % DCP
    local = (o // (DCP * interleave)) * interleave + o % interleave
    return [(single[:, o[owner == r]], shards[r][:, local[owner == r]]) for r in range(DCP)]


def _check(cases: list[Case]) -> dict[str, float]:
    per_rank = run_on_ranks(_run_cases, TP, cases, timeout=600)
    worst: dict[str, float] = {}
    for i, case in enumerate(cases):
        ref = _caches(case, BLOCK * DCP)
        tol = 1e-5 if case.dtype == torch.float32 else 2e-2
        for step, meta in enumerate(two_step_metas(case.batch, dcp=DCP, block_size=BLOCK, num_blocks=NUM_BLOCKS)):
            want_topk, want = _step(_inputs(case, meta.num_tokens, seed=step), ref, meta)
            assert (want_topk >= 0).any() and (want_topk == -1).any(), "the case must select and pad"
            for r in range(TP):
                assert torch.equal(per_rank[r][i][0][step][0], want_topk), (case, step, r)
            got = torch.cat([per_rank[r][i][0][step][1] for r in range(TP)], dim=1)  # heads in rank order
            assert torch.isfinite(got.float()).all(), case
            worst[str(case)] = max(worst.get(str(case), 0.0), (got.float() - want.float()).abs().max().item())
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=f"{case} step {step}")
        # The owner rank holds the single device's codes (the same write of the same inputs) and scale.
        for j, single in enumerate(ref[:2]):
            for want_rows, got_rows in _owner_view(single, [per_rank[r][i][1][j] for r in range(TP)], case.interleave):
                if j == 0:
                    assert torch.equal(got_rows.view(torch.uint8), want_rows.view(torch.uint8)), (case, "codes")
                else:
                    torch.testing.assert_close(got_rows, want_rows, atol=0, rtol=1e-6, msg=f"{case} scales")
        assert ref[1].abs().sum() > 0 and ref[0].view(torch.uint8).any()  # something was written and compared
    return worst


def test_sfa_quantised_dcp2_matches_one_device_with_the_same_quantised_cache(summary_note):
    """int8 and fp8, fp32 and bf16 models, interleave 1 / 2 / block, both merges, mixed, decode
    and spec-decode batches: one spawned world (its start is most of the time)."""
    worst = _check(CASES)
    summary_note("SFA quantised DCP (tp = dcp = 2, int8 / fp8): max |out diff| vs one device with the same "
                 "quantised cache " + ", ".join(f"{c.kv_dtype} {str(c.dtype)[6:]} {worst[str(c)]:.1e}" for c in CASES))


# ----------------------------------------------------------------------------- one device, in process


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8_e4m3"])
def test_quantised_op_equals_model_dtype_op_on_the_dequantised_cache(kv_dtype):
    """The quant op = its write (kv_quant.write_quantized: codes and one scale per token) then the
    model-dtype op's attention over `code * scale`; the padded, -1 and context rows included."""
    case = Case(kv_dtype, torch.float32, 1)
    metas = two_step_metas("mixed", dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    latent, scales, index_cache = _caches(case, BLOCK)
    topks = []
    for step, meta in enumerate(metas):
        x = _inputs(case, meta.num_tokens, seed=step)
        topk, got = _step(x, (latent, scales, index_cache), meta)
        topks.append(topk)
    # The same last step over a float cache holding the dequantised rows: the new tokens are
    # written into it by the model-dtype op, so give it their dequantised values too.
    deq = kv_quant.dequantize(latent, scales[..., 0])  # [NB, BS, L+R] fp32
    q, s = kv_quant.quantize(torch.cat([x["kv_c"], x["k_pe"]], dim=-1), PAGE[kv_dtype])
    new_deq = kv_quant.dequantize(q, s)  # [T, L+R]
    want = torch.ops.cp.sparse_mla_attention(x["q_nope"], x["q_pe"], new_deq[:, :L], new_deq[:, L:], deq,
                                             *meta_args(meta), topk, SCALE)
    assert (topk >= 0).sum() > 4
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # and the quantisation is felt: the model-dtype op over the unrounded values differs
    exact = torch.zeros(NUM_BLOCKS, BLOCK, L + R)
    for step, m in enumerate(metas):
        xs = _inputs(case, m.num_tokens, seed=step)
        ex = torch.ops.cp.sparse_mla_attention(xs["q_nope"], xs["q_pe"], xs["kv_c"], xs["k_pe"], exact,
                                               *meta_args(m), topks[step], SCALE)
    assert (ex - got).abs().max() > 1e-4

def test_sfa_cache_allocation_and_refusals():
    """allocate_kv_cache: the latent quantised with one fp32 scale per token, the indexer's keys in
    the model's dtype; CPConfig accepts SFA with a quantised cache (DSA-CP too), the P/D transfer
    geometry refuses it; a quantised latent without its scales (or with
    scales of the wrong shape) is refused before anything is written."""
    spec = KVCacheSpec(num_layers=2, kind="sfa", latent_dim=L + R, index_dim=DI)
    cfg = cp_compile.CPConfig(block_size=BLOCK, kv_cache_dtype="fp8_e4m3")
    cfg.validate_for(cp_compile.AttentionSpec("sfa", 4, has_indexer=True))
    cache = allocate_kv_cache(cfg, spec, 8, dtype=torch.bfloat16, device="meta")
    latent, scale = cache.layers[0]
    assert latent.dtype == torch.float8_e4m3fn and latent.shape == (8, BLOCK, L + R)
    assert scale.dtype == torch.float32 and scale.shape == (8, BLOCK, 1)
    assert cache.replicated[0].dtype == torch.bfloat16 and cache.replicated[0].shape == (8, BLOCK, DI)
    assert cache.scale_bytes == 2 * 8 * BLOCK * 4
    cp_compile.CPConfig(kv_cache_dtype="int8", enable_dsa_cp=True, tensor_parallel_size=2).validate_for(
        cp_compile.AttentionSpec("sfa", 4, has_indexer=True))  # DSA-CP reads the scales too
    # P/D transfer (decision 76): the geometry counts the indexer keys at their own dtype, and one
    # that does not name it is refused rather than count fp8-sized index rows
    attn = cp_compile.AttentionSpec("sfa", 4, has_indexer=True)
    with pytest.raises(cp_compile.ConfigError, match=r"kv_cache_dtype='fp8_e4m3', index_dtype=None.*Fix: pass "
                                                      r"index_dtype=KVCache.replicated\[0\].dtype"):
        KVGeometry.of(spec, attn, latent.dtype, "fp8_e4m3")
    geo = KVGeometry.of(spec, attn, latent.dtype, "fp8_e4m3", index_dtype=cache.replicated[0].dtype)
    assert geo.element_size == 1 and geo.index_element_size == 2

    meta = two_step_metas("decode", dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)[0]
    x = _inputs(Case("int8", torch.float32, 1), meta.num_tokens, 0)
    codes = torch.zeros(NUM_BLOCKS, BLOCK, L + R, dtype=torch.int8)
    topk = torch.zeros(meta.num_tokens, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="scale cache .* does not fit"):
        torch.ops.cp.sparse_mla_attention_quant(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], codes,
                                                torch.zeros(NUM_BLOCKS, BLOCK, 2), *meta_args(meta), topk, SCALE)
    assert not codes.any()  # refused before the write
    with pytest.raises(ValueError, match="kv_cache is torch.int8 .* no scale cache was passed"):
        torch.ops.cp.sparse_mla_partial_attention(x["q_nope"], x["q_pe"], codes, meta.block_table,
                                                  meta.query_start_loc, topk, SCALE)


def test_opcheck_quantised_sparse_ops():
    meta = two_step_metas("decode", dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)[0]
    x = _inputs(Case("int8", torch.float32, 1), meta.num_tokens, 0)
    codes = torch.randint(-127, 128, (NUM_BLOCKS, BLOCK, L + R), dtype=torch.int8)
    scales = torch.rand(NUM_BLOCKS, BLOCK, 1) / 50 + 0.01
    topk = torch.tensor([[0, 2, -1]] * meta.num_tokens, dtype=torch.int32)
    torch.library.opcheck(torch.ops.cp.sparse_mla_attention_quant,
                          (x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], codes, scales, *meta_args(meta), topk,
                           SCALE))
    torch.library.opcheck(torch.ops.cp.sparse_mla_partial_attention,
                          (x["q_nope"], x["q_pe"], codes, meta.block_table, meta.query_start_loc, topk, SCALE, scales))


# ----------------------------------------------------------------------------- DSA-CP (token-sharded rows)


def _dsa_cp_world(rank: int, world: int, cases: list[Case]):
    from cp_compile.ops.parallel import dsa_cp as S

    spec = cp_compile.AttentionSpec("sfa", H, has_indexer=True)
    results = []
    for case in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=world, enable_dsa_cp=True, block_size=BLOCK,
                                  kv_cache_dtype=case.kv_dtype)
        cfg.validate_for(spec)
        state = cp_compile.init_parallel(cfg, device="cpu")
        ctx = CompileContext.from_state(state, attention=spec).tp_view()
        latent, scales, _ = _caches(case, BLOCK)
        index_cache = torch.zeros(NUM_BLOCKS, BLOCK, DI)  # dcp 1: every rank holds every key, as one device
        heads = slice(rank * H // world, (rank + 1) * H // world)
        outs = []
        for step, meta in enumerate(two_step_metas(case.batch, dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)):
            x = _inputs(case, meta.num_tokens, seed=step)
            rows = S.dsa_cp_indexer(x["q_i"], x["k_i"], x["w"], index_cache, *meta_args(meta), TOPK, ctx)
            outs.append(S.dsa_cp_sparse_attention(x["q_nope"][:, heads], x["q_pe"][:, heads], x["kv_c"], x["k_pe"],
                                                  latent, *meta_args(meta), rows, SCALE, ctx, kv_scale_cache=scales))
        results.append((outs, latent, scales))
        cp_compile.destroy_parallel()
    return results


def test_dsa_cp_quantised_matches_one_device_with_the_same_quantised_cache():
    """DSA-CP at tp 2 (token-sharded indexer rows and sparse MLA rows, every rank writing the
    whole latent) over int8 and fp8 latents: outputs within 1e-5 of one device with the same
    quantised cache, every rank's codes byte-equal and scales equal to the single device's."""
    cases = [Case("int8", torch.float32, 1), Case("fp8_e4m3", torch.float32, 1, batch="spec_decode")]
    per_rank = run_on_ranks(_dsa_cp_world, TP, cases, timeout=600)
    for i, case in enumerate(cases):
        latent, scales, _ = _caches(case, BLOCK)
        index_cache = torch.zeros(NUM_BLOCKS, BLOCK, DI)
        for step, meta in enumerate(two_step_metas(case.batch, dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)):
            _, want = _step(_inputs(case, meta.num_tokens, seed=step), (latent, scales, index_cache), meta)
            got = torch.cat([per_rank[r][i][0][step] for r in range(TP)], dim=1)  # heads in rank order
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"DSA-CP {case} step {step}")
        for r in range(TP):
            assert torch.equal(per_rank[r][i][1].view(torch.uint8), latent.view(torch.uint8)), (case, r, "codes")
            torch.testing.assert_close(per_rank[r][i][2], scales, atol=0, rtol=1e-6, msg=f"{case} rank {r} scales")
        assert scales.abs().sum() > 0
