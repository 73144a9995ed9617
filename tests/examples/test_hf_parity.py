"""The example models are the real architectures: logits match HF `transformers`.

Tiny random HF models (Qwen3 GQA; DeepSeek-V3 MLA with q_lora and both rope
layouts; DeepSeek-V2-Lite-style MLA without q_lora; DeepSeek-V3.2 and GLM-5
(`glm_moe_dsa`) sparse MLA with a lightning indexer) are built offline, their state
dicts loaded into the example models (tp_size=1), and a serving-like sequence of
steps runs through the paged-cache custom ops: chunked prefill, a mixed
prefill+decode batch, decode with padding tokens, and multi-token decode. Every
step's logits must equal HF's full-sequence forward at the same positions.
"""

from __future__ import annotations

import pytest
import torch

from cp_compile.base.config import CPConfig
from cp_compile.runtime.kv_cache import allocate_kv_cache
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from examples.models import deepseek_mla, qwen3
from examples.models.deepseek_mla import DeepseekMLAConfig
from examples.models.qwen3 import Qwen3Model
from examples.models.deepseek_sfa import DeepseekSFAConfig
from examples.models.tiny import (VOCAB, example_from_hf, hf_deepseek_sfa, hf_deepseek_v2_lite, hf_deepseek_v3,
                                  hf_qwen3)
from examples.serving import layer_caches

ATOL = RTOL = 1e-4

# One serving-like sequence of steps over two requests: per step, (context_len,
# new_tokens) per request plus padding tokens at the end of the flattened batch.
STEPS: list[tuple[list[tuple[int, int]], int]] = [
    ([(0, 7), (0, 5)], 0),  # prefill req 0, first chunk of req 1
    ([(7, 1), (5, 7)], 0),  # decode req 0, rest of req 1 (mixed batch, chunked prefill)
    ([(8, 1), (12, 1)], 3),  # decode both, 3 padding tokens (graph-mode batch padding)
    ([(9, 2), (13, 1)], 0),  # two query tokens for req 0 (speculative decode)
]


# --------------------------------------------------------------------------- driver


def run_steps(model, block_size: int, seed: int = 0, compiled=None):
    """Run STEPS through `model` (or `compiled`); returns per step (logits, requests, tokens, npad)."""
    g = torch.Generator().manual_seed(seed)
    cfg = CPConfig(block_size=block_size)
    cache = allocate_kv_cache(cfg, model.kv_cache_spec(), num_blocks=16, attention=model.attention_spec())
    alloc = BlockAllocator(16, cfg.virtual_block_size)
    tokens: list[list[int]] = [[], []]
    out = []
    fn = model if compiled is None else compiled
    for requests, npad in STEPS:
        # A fixed block-table width, as a graph-mode runtime keeps it (static shapes).
        meta = build_attention_metadata(requests, alloc, num_padding_tokens=npad, max_blocks_per_req=8)
        new = [torch.randint(0, VOCAB, (n,), generator=g) for _, n in requests]
        for b, ((ctx, _), t) in enumerate(zip(requests, new)):
            assert len(tokens[b]) == ctx
            tokens[b] += t.tolist()
        input_ids = torch.cat(new + [torch.zeros(npad, dtype=torch.int64)])  # [T]
        with torch.no_grad():
            logits = fn(input_ids, meta.positions, layer_caches(cache), meta)  # [T, vocab]
        assert logits.shape == (input_ids.shape[0], VOCAB) and logits.dtype == torch.float32
        out.append((logits, requests, [list(t) for t in tokens], npad))
    return out, cache


def assert_matches_hf(hf_model, model, block_size: int) -> None:
    steps, _ = run_steps(model, block_size)
    for step, (logits, requests, tokens, npad) in enumerate(steps):
        assert torch.isfinite(logits).all()
        start = 0
        for b, (ctx, n) in enumerate(requests):
            ids = torch.tensor(tokens[b][: ctx + n])[None]
            with torch.no_grad():
                ref = hf_model(input_ids=ids).logits[0, ctx: ctx + n].float()  # [n, vocab]
            torch.testing.assert_close(logits[start: start + n], ref, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"step {step}, request {b}: {m}")
            start += n
        assert start + npad == logits.shape[0]


# --------------------------------------------------------------------------- parity tests


@pytest.mark.parametrize("tie,bias", [(False, False), (True, True)], ids=["untied", "tied_bias"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_qwen3_matches_hf(tie: bool, bias: bool, block_size: int) -> None:
    hf = hf_qwen3(tie=tie, bias=bias)
    assert_matches_hf(hf, example_from_hf(hf), block_size)


@pytest.mark.parametrize("q_lora_rank,rope_interleave", [(24, True), (None, False)],
                         ids=["q_lora_interleaved_rope", "no_q_lora_neox_rope"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_deepseek_v3_matches_hf(q_lora_rank: int | None, rope_interleave: bool, block_size: int) -> None:
    hf = hf_deepseek_v3(q_lora_rank, rope_interleave)
    model = example_from_hf(hf)
    assert model.cfg.rope_interleave == rope_interleave
    assert_matches_hf(hf, model, block_size)


def test_deepseek_v2_lite_matches_hf() -> None:
    """V2-Lite shape: q_lora_rank None (q_proj directly), complex-multiplication rope."""
    hf = hf_deepseek_v2_lite()
    model = example_from_hf(hf)
    assert model.cfg.q_lora_rank is None and model.cfg.rope_interleave
    assert_matches_hf(hf, model, 4)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
@pytest.mark.parametrize("block_size", [4, 8])
def test_deepseek_sfa_matches_hf(model_type: str, block_size: int) -> None:
    """MLA + lightning indexer (V3.2: neox indexer rope; GLM-5: interleaved), top-k 5
    of up to 14 keys, so most queries attend a strict subset of their context."""
    hf = hf_deepseek_sfa(model_type)
    model = example_from_hf(hf)
    assert model.cfg.indexer_rope_interleave == (model_type == "glm_moe_dsa")
    assert model.cfg.index_topk == 5 < max(c + n for reqs, _ in STEPS for c, n in reqs)
    assert_matches_hf(hf, model, block_size)


def test_deepseek_sfa_sparsity_matters() -> None:
    """The same weights attending every causal key give other logits: the indexer's
    selection (not just the MLA) is what the parity test pins."""
    hf = hf_deepseek_sfa("deepseek_v32")
    sparse, _ = run_steps(example_from_hf(hf), 4)
    dense_model = example_from_hf(hf)
    for layer in dense_model.layers:
        layer.self_attn.indexer.topk = 64
    dense, _ = run_steps(dense_model, 4)
    # <= 5 causal keys: both paths select every key, so the math is the same but the
    # reductions are not (sparse gather vs dense softmax): equal to fp32 tolerance, not
    # bitwise (9.9e-7 apart on an AMD EPYC, issue 19).
    torch.testing.assert_close(dense[0][0][:5], sparse[0][0][:5], atol=1e-5, rtol=1e-5)
    assert (dense[-1][0] - sparse[-1][0]).abs().max() > 1e-2


def test_sfa_shared_indexer_layers_are_rejected() -> None:
    cfg = hf_deepseek_sfa("glm_moe_dsa").config
    cfg.indexer_types = ["full", "shared"]
    with pytest.raises(NotImplementedError, match="shared"):
        DeepseekSFAConfig.from_hf(cfg)


def test_moe_layers_are_rejected() -> None:
    cfg = hf_deepseek_v3().config
    cfg.first_k_dense_replace = 1
    with pytest.raises(NotImplementedError, match="first_k_dense_replace"):
        DeepseekMLAConfig.from_hf(cfg)


def test_cache_specs() -> None:
    q = example_from_hf(hf_qwen3())
    spec = q.kv_cache_spec()
    assert (spec.kind, spec.num_layers, spec.num_kv_heads_per_rank, spec.head_dim) == ("gqa", 2, 2, 16)
    assert (q.attention_spec().kind, q.attention_spec().num_heads, q.attention_spec().num_kv_heads) == ("gqa", 4, 2)
    assert Qwen3Model(q.cfg, tp_size=4, tp_rank=3).kv_cache_spec().num_kv_heads_per_rank == 1
    m = example_from_hf(hf_deepseek_v3())
    spec = m.kv_cache_spec()
    assert (spec.kind, spec.num_layers, spec.latent_dim) == ("mla", 2, 32 + 8)
    assert (m.attention_spec().kind, m.attention_spec().num_heads) == ("mla", 4)
    s = example_from_hf(hf_deepseek_sfa())
    spec = s.kv_cache_spec()
    assert (spec.kind, spec.num_layers, spec.latent_dim, spec.index_dim) == ("sfa", 2, 32 + 8, 16)
    a = s.attention_spec()
    assert (a.kind, a.num_heads, a.has_indexer) == ("sfa", 4, True)


# --------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("which", ["qwen3", "deepseek_v3"])
def test_compiled_fullgraph_matches_eager(which: str) -> None:
    """fullgraph=True traces (no graph breaks) and matches eager, caches included."""
    import torch._dynamo

    hf = hf_qwen3() if which == "qwen3" else hf_deepseek_v3()
    model = example_from_hf(hf)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    eager_steps, eager_cache = run_steps(model, 4)
    comp_steps, comp_cache = run_steps(model, 4, compiled=compiled)
    for (le, *_), (lc, *_) in zip(eager_steps, comp_steps):
        torch.testing.assert_close(lc, le, atol=1e-5, rtol=1e-5)
    for layer_e, layer_c in zip(eager_cache.layers, comp_cache.layers):
        for te, tc in zip(layer_e, layer_c):  # projections lowered twice: fp32 tolerance (issue 19)
            torch.testing.assert_close(tc, te, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


# --------------------------------------------------------------------------- TP sharding


def _full_vs_shards(full: torch.Tensor, shards: list[torch.Tensor], dim: int) -> None:
    torch.testing.assert_close(torch.cat(shards, dim=dim), full, atol=0, rtol=0)


@pytest.mark.parametrize("tp", [2, 4])
def test_qwen3_tp_shards_concatenate_to_hf_weights(tp: int) -> None:
    """tp=2: KV heads split (1 per rank); tp=4 > 2 KV heads: each KV head on 2 ranks."""
    hf = hf_qwen3(bias=True)
    sd = hf.state_dict()
    ranks = [example_from_hf(hf, tp, r) for r in range(tp)]
    kv_rep = max(tp // hf.config.num_key_value_heads, 1)
    for i in range(hf.config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn = [m.layers[i].self_attn for m in ranks]
        mlp = [m.layers[i].mlp for m in ranks]
        _full_vs_shards(sd[f"{p}.self_attn.q_proj.weight"], [a.q_proj.weight for a in attn], 0)
        _full_vs_shards(sd[f"{p}.self_attn.q_proj.bias"], [a.q_proj.bias for a in attn], 0)
        for name in ("k_proj", "v_proj"):
            distinct = [getattr(a, name).weight for a in attn][::kv_rep]  # one per KV-head shard
            _full_vs_shards(sd[f"{p}.self_attn.{name}.weight"], distinct, 0)
            for r, a in enumerate(attn):  # replicas are identical
                torch.testing.assert_close(getattr(a, name).weight, distinct[r // kv_rep], atol=0, rtol=0)
        _full_vs_shards(sd[f"{p}.self_attn.o_proj.weight"], [a.o_proj.weight for a in attn], 1)
        torch.testing.assert_close(attn[-1].o_proj.bias, sd[f"{p}.self_attn.o_proj.bias"], atol=0, rtol=0)
        _full_vs_shards(sd[f"{p}.mlp.gate_proj.weight"], [m.gate_proj.weight for m in mlp], 0)
        _full_vs_shards(sd[f"{p}.mlp.up_proj.weight"], [m.up_proj.weight for m in mlp], 0)
        _full_vs_shards(sd[f"{p}.mlp.down_proj.weight"], [m.down_proj.weight for m in mlp], 1)
    # GQA grouping stays right on every rank: local q head j reads local KV head j // (Hq_local // Hkv_local),
    # i.e. global q head h reads global KV head h // (Hq // Hkv).
    group = hf.config.num_attention_heads // hf.config.num_key_value_heads
    for r, m in enumerate(ranks):
        a = m.layers[0].self_attn
        kv_first = (r // kv_rep) * a.num_kv_heads if tp >= hf.config.num_key_value_heads else r * a.num_kv_heads
        for j in range(a.num_heads):
            h = r * a.num_heads + j
            assert kv_first + j // (a.num_heads // a.num_kv_heads) == h // group


def test_mla_tp_shards_concatenate_to_hf_weights() -> None:
    tp = 2
    hf = hf_deepseek_v3(q_lora_rank=24)
    cfg = hf.config
    sd = hf.state_dict()
    ranks = [example_from_hf(hf, tp, r) for r in range(tp)]
    H, nope, dv, L = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn"
        attn = [m.layers[i].self_attn for m in ranks]
        _full_vs_shards(sd[f"{p}.q_b_proj.weight"], [a.q_b_proj.weight for a in attn], 0)
        _full_vs_shards(sd[f"{p}.o_proj.weight"], [a.o_proj.weight for a in attn], 1)
        for a in attn:  # the latent path is replicated
            torch.testing.assert_close(a.q_a_proj.weight, sd[f"{p}.q_a_proj.weight"], atol=0, rtol=0)
            torch.testing.assert_close(a.kv_a_proj_with_mqa.weight, sd[f"{p}.kv_a_proj_with_mqa.weight"],
                                       atol=0, rtol=0)
        kv_b = sd[f"{p}.kv_b_proj.weight"].view(H, nope + dv, L)
        _full_vs_shards(kv_b[:, :nope], [a.w_uk for a in attn], 0)
        _full_vs_shards(kv_b[:, nope:].transpose(1, 2), [a.w_uv for a in attn], 0)


def test_load_rejects_wrong_tp_and_unknown_keys() -> None:
    hf = hf_qwen3()
    model = example_from_hf(hf)
    with pytest.raises(ValueError, match="tp_size"):
        qwen3.load_hf_state_dict(model, hf.state_dict(), tp_size=2, tp_rank=0)
    sd = dict(hf.state_dict())
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="not used"):
        qwen3.load_hf_state_dict(model, sd, tp_size=1, tp_rank=0)
    mla_hf = hf_deepseek_v3()
    mla = example_from_hf(mla_hf)
    deepseek_mla.load_hf_state_dict(mla, mla_hf.state_dict(), tp_size=1, tp_rank=0)
