"""Compiled example models at dcp 2 over a quantised KV cache (issue 39) == one device in eager
with the same quantised cache: the DCP pass hands each layer's scale caches to the
compositions (the cache write quantises on the owner rank, the partial attention dequantises).

One spawned world of 2 gloo ranks (tp = dcp = 2) compiles the GQA (Qwen3-style, int8) and the
MLA (DeepSeek-style, fp8) example models with aot_eager and runs the tiny schedule (prefill,
decodes, a request joining and one leaving, padding) on each. Logits within 1e-4 and the
same greedy tokens as the single-device eager run.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile.passes.context import CompileContext
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.testing.multirank import run_on_ranks
from cp_compile.testing.pass_harness import run_pipeline
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_sfa, hf_deepseek_v3, hf_qwen3
from examples.serving import layer_caches, run_schedule, tiny_schedule

BLOCK, NUM_BLOCKS, STEPS = 4, 12, 8
CASES = (("qwen3", "int8"), ("mla", "fp8_e4m3"))
SFA_CASES = (("sfa", "int8"), ("sfa", "fp8_e4m3"))


def _hf(kind: str):
    if kind == "sfa":  # DeepSeek-V3.2 style: MLA + lightning indexer, top-k 5 below the requests' lengths
        return hf_deepseek_sfa("deepseek_v32", num_heads=4)
    return hf_qwen3(num_kv_heads=1, num_heads=4) if kind == "qwen3" else hf_deepseek_v3(q_lora_rank=None, num_heads=4)


def _world(rank: int, world: int, models: list[tuple[str, str, object, dict]], fold: str = "off"):
    out = []
    for kind, kv_dtype, hf_config, sd in models:
        cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=world, block_size=BLOCK,
                                  dcp_merge="ag_rs", kv_cache_dtype=kv_dtype, dcp_merge_fold=fold)
        state = cp_compile.init_parallel(cfg, device="cpu")
        model = example_from_config(hf_config, sd, world, state.layout.tp.rank, state.tp_group)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
        compiled = cp_compile.compile_model(model, lowering="aot_eager")
        res = run_schedule(compiled, layer_caches(cache), cfg, NUM_BLOCKS, tiny_schedule(VOCAB, num_steps=STEPS))
        hist = compiled.backend.pass_managers[0].history[-1].after
        folded = sum(h.rewrites for h in compiled.backend.pass_managers[0].history if h.name == "allreduce_fold")
        rewrites = {h.name: h.rewrites for h in compiled.backend.pass_managers[0].history}
        out.append(dict(results=res, after=hist, scale_bytes=cache.scale_bytes, folded=folded, rewrites=rewrites,
                        layers=[tuple(t.clone() for t in layer) for layer in cache.layers]))
        cp_compile.destroy_parallel()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("fold", ["off", "on"])
def test_compiled_dcp2_quantised_model_matches_single_device(fold: str):
    """`-m slow` (~70 s: a spawned world, two aot_eager compiles); the default run checks the
    pass's plumbing in process (below) and the numerics per op on gloo ranks
    (tests/ops/test_quant_kv_dcp.py). `fold="on"`: the merges folded into the TP all-reduce
    (decision 62) over the quantised caches."""
    models = []
    for kind, kv_dtype in CASES:
        hf = _hf(kind)
        models.append((kind, kv_dtype, hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()}))
    per_rank = run_on_ranks(_world, 2, models, fold, timeout=900)
    _compare(models, per_rank, fold)


def _compare(models, per_rank, fold: str = "off") -> None:
    for i, (kind, kv_dtype, hf_config, sd) in enumerate(models):
        model = example_from_config(hf_config, sd)
        cfg = cp_compile.CPConfig(block_size=BLOCK * 2, kv_cache_dtype=kv_dtype)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS)
        ref = run_schedule(model, layer_caches(cache), cfg, NUM_BLOCKS, tiny_schedule(VOCAB, num_steps=STEPS))
        for rank, out in enumerate(per_rank):
            got = out[i]
            assert got["scale_bytes"] * 2 == cache.scale_bytes  # the scales are sharded with the pages
            assert got["folded"] == (hf_config.num_hidden_layers if fold == "on" else 0)
            # no single-device attention op left: the pass rewrote them, scales and all
            assert not any("gqa_paged_attention" in k or "cp.mla_attention" in k or "cp.sparse_mla_attention" in k
                           for k in got["after"]), got["after"]
            if kind == "sfa":  # every layer's quantised sparse MLA rewritten by the SFA DCP pass
                assert got["rewrites"]["sfa_dcp"] == hf_config.num_hidden_layers, got["rewrites"]
                # each token's latent codes (byte-equal) and scale on its owner rank (interleave 1:
                # virtual offset o on rank o % 2 at local offset o // 2)
                for want_layer, got_layer in zip(cache.layers, got["layers"]):
                    for j, (w_t, g_t) in enumerate(zip(want_layer, got_layer)):
                        mine = w_t[:, rank::2]
                        if j == 0:
                            assert torch.equal(g_t.view(torch.uint8), mine.view(torch.uint8)), (kv_dtype, rank)
                        else:
                            torch.testing.assert_close(g_t, mine, atol=0, rtol=1e-6)
            for step, (g, w) in enumerate(zip(got["results"], ref)):
                torch.testing.assert_close(g.last_logits, w.last_logits, atol=1e-4, rtol=1e-4,
                                           msg=f"{kind} {kv_dtype} rank {rank} step {step}")
                assert g.next_tokens == w.next_tokens, (kind, rank, step)


@pytest.mark.slow
def test_compiled_dcp2_quantised_sfa_model_matches_single_device():
    """`-m slow` (a spawned world, two aot_eager compiles): the DeepSeek-V3.2-style SFA example
    model (MLA + lightning indexer, top-k 5) at tp = dcp = 2 with an int8 and an fp8 latent
    (the indexer's keys in the model's dtype) == one device in eager with the same quantised
    cache: logits 1e-4, greedy tokens, each token's codes and scale on its owner rank."""
    models = []
    for kind, kv_dtype in SFA_CASES:
        hf = _hf(kind)
        models.append((kind, kv_dtype, hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()}))
    _compare(models, run_on_ranks(_world, 2, models, timeout=900))


class _Layers(torch.nn.Module):
    """Two GQA layers over int8 caches with their scale caches, and two MLA layers over fp8."""

    def forward(self, x, caches, meta):
        args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc)
        T = x.shape[0]
        q = x.view(T, 4, 24)
        for i in range(2):
            k, v, ks, vs = caches[4 * i:4 * i + 4]
            x = x + torch.ops.cp.gqa_paged_attention_quant(q[..., :16], q[:, :1, :16], q[:, :1, :8], k, v, ks, vs,
                                                           *args, 0.5).sum()
        for i in range(2):
            kv, s = caches[8 + 2 * i:10 + 2 * i]
            x = x + torch.ops.cp.mla_attention_quant(q[..., :16], q[..., 16:], q[:, 0, :16], q[:, 0, 16:], kv, s,
                                                     *args, 0.5).sum()
        return x


def test_dcp_pass_hands_the_scale_caches_to_every_write_and_read():
    """In process (no ranks): after the DCP pass every cache write and partial attention of a
    layer takes that layer's scale caches (graph inputs), none is dropped or swapped."""
    meta = build_attention_metadata([(0, 3), (0, 2)], BlockAllocator(8, 4))
    caches = []
    for _ in range(2):
        caches += [torch.zeros(8, 4, 1, 16, dtype=torch.int8), torch.zeros(8, 4, 1, 8, dtype=torch.int8),
                   torch.zeros(8, 4, 1), torch.zeros(8, 4, 1)]
    for _ in range(2):
        caches += [torch.zeros(8, 4, 24, dtype=torch.float8_e4m3fn), torch.zeros(8, 4, 1)]
    cfg = cp_compile.CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4,
                              dcp_merge="ag_rs", kv_cache_dtype="int8")
    ctx = CompileContext.for_test(cfg, attention=cp_compile.AttentionSpec("gqa", 8, 1))
    pm, gm = run_pipeline(_Layers(), (torch.randn(meta.num_tokens, 96), caches, meta), ctx)
    assert pm.history[0].rewrites == 4
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]

    def arg(n, i, name):
        return n.args[i] if len(n.args) > i else n.kwargs.get(name)

    writes = [n for n in nodes if n.target == torch.ops.cp.quant_cache_write.default]
    reads = [n for n in nodes if n.target in (torch.ops.cp.paged_attention_lse.default,
                                              torch.ops.cp.mla_partial_attention.default)]
    assert len(writes) == 2 * 2 + 2 and len(reads) == 4
    def idx(n):  # the caches list index of a placeholder (Dynamo names it l_caches_<i>_)
        assert n in placeholders and n.name.startswith("l_caches_"), n
        return int(n.name.split("_")[2])

    # GQA layer i: k (4i) with its scales (4i + 2), v (4i + 1) with (4i + 3); MLA layer j: (8 + 2j, 9 + 2j)
    pairs = sorted((idx(arg(w, 1, "cache")), idx(arg(w, 2, "scale_cache"))) for w in writes)
    assert pairs == [(0, 2), (1, 3), (4, 6), (5, 7), (8, 9), (10, 11)], pairs
    reads_pairs = sorted(tuple(idx(a) for a in r.args[1:3] if a in placeholders) + tuple(idx(a) for a in r.args[7:])
                         for r in reads)
    # paged_attention_lse(q, k, v, ..., ks, vs); mla_partial_attention(q_nope, q_pe, kv, ..., kv_scale)
    assert reads_pairs == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9), (10, 11)], reads_pairs


class _SparseLayers(torch.nn.Module):
    """Two SFA layers over int8 latents with their scale caches, and their indexers' caches."""

    def forward(self, x, caches, meta):
        args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc)
        T = x.shape[0]
        q = x.view(T, 4, 24)
        for i in range(2):
            kv, s, index_cache = caches[3 * i:3 * i + 3]
            topk = torch.ops.cp.lightning_indexer(q[:, :2, :8], q[:, 0, 8:16], q[:, 0, :2], index_cache, *args, 3)
            x = x + torch.ops.cp.sparse_mla_attention_quant(q[..., :16], q[..., 16:], q[:, 0, :16], q[:, 0, 16:], kv,
                                                            s, *args, topk, 0.5).sum()
        return x


def test_sfa_dcp_pass_hands_the_scale_caches_to_every_write_and_read():
    """In process: after the SFA DCP pass each layer's owner write (`cp::quant_cache_write`) and
    sparse partial (`cp::sparse_mla_partial_attention`) take that layer's own scale cache."""
    meta = build_attention_metadata([(0, 3), (0, 2)], BlockAllocator(8, 8))
    caches = []
    for _ in range(2):
        caches += [torch.zeros(8, 4, 24, dtype=torch.int8), torch.zeros(8, 4, 1), torch.zeros(8, 8, 8)]
    cfg = cp_compile.CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4,
                              dcp_merge="ag_rs", kv_cache_dtype="int8")
    ctx = CompileContext.for_test(cfg, attention=cp_compile.AttentionSpec("sfa", 8, has_indexer=True))
    pm, gm = run_pipeline(_SparseLayers(), (torch.randn(meta.num_tokens, 96), caches, meta), ctx)
    assert {h.name: h.rewrites for h in pm.history}["sfa_dcp"] == 2
    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    assert not any(n.target == torch.ops.cp.sparse_mla_attention_quant.default for n in nodes)

    def idx(n):  # the caches list index of a placeholder (Dynamo names it l_caches_<i>_)
        assert n in placeholders and n.name.startswith("l_caches_"), n
        return int(n.name.split("_")[2])

    writes = [n for n in nodes if n.target == torch.ops.cp.quant_cache_write.default]
    reads = [n for n in nodes if n.target == torch.ops.cp.sparse_mla_partial_attention.default]
    assert sorted((idx(w.args[1]), idx(w.args[2])) for w in writes) == [(0, 1), (3, 4)]
    # sparse_mla_partial_attention(q_nope, q_pe, kv_cache, block_table, qsl, indices, scale, kv_scale_cache)
    assert sorted((idx(r.args[2]), idx(r.args[7])) for r in reads) == [(0, 1), (3, 4)]
    assert not any(n.target == torch.ops.cp.cache_write.default for n in nodes)  # no unquantised write left
