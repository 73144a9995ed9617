"""The HF engine with a quantised KV cache (issue 39, decision 71): `CPConfig(kv_cache_dtype=...)`
through `cp_compile.serving.hf.Engine`, `EngineArgs` / `LLM` / `serve --kv-cache-dtype`, a
checkpoint's static per-layer k_scale / v_scale, and the start-up report's scale bytes.

Exactness: the engine at tp = dcp = 2 (gloo) == the engine on one device with the same
quantised cache (greedy tokens equal, logits within 1e-4); with static scales, the engine ==
HF's own generate with K / V fake-quantised by the same static scales (an independent
reference: HF's sdpa attention over `dequant(quant(k, s))`).
"""

from __future__ import annotations

import copy
import os
import time

import pytest
import torch
import transformers

import cp_compile
import cp_compile.serving.hf
from cp_compile.base.errors import ConfigError
from cp_compile.serving.entrypoints import cli
from cp_compile.serving.entrypoints.executors import EngineArgs, build_engine
from cp_compile.serving.hf.kv_budget import plan_pool
from cp_compile.serving.hf.kv_scales import KVScales, read_kv_scales, scales_of
from cp_compile.testing.multirank import run_on_ranks
from examples.hf_generate import tiny_hf
from examples.models.tiny import VOCAB

BLOCK = 4
NUM_BLOCKS = 16
MAX_NEW = [8, 5, 8]  # request 1 leaves early
ARRIVALS = [0, 0, 2]  # request 2 joins at step 2 (a prefill beside decodes)
FP8_MAX = 448.0


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles its engines afresh: the HF models' forward code objects are shared by
    every engine in this worker process (xdist runs other HF files before this one), and without
    a reset their cache entries reach dynamo's recompile limit, a hard failure under fullgraph
    (seen in a fresh-clone CI run on `test_llm_with_a_quantised_cache_equals_the_engine`)."""
    torch._dynamo.reset()
    yield


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 5)]


def _written_scales(engine) -> list[list[torch.Tensor]]:
    """Per layer, per scale cache: the scales of the slots written (non-zero: the caches start at 0).
    Layers: GQA (k, v, k_scale, v_scale), MLA (latent, latent_scale), SFA (latent, latent_scale, index)."""
    out = []
    for layer in engine.cache.layers:
        scales = layer[1:2] if engine.kind == "sfa" else layer[len(layer) // 2:]
        out.append([s[s != 0] for s in scales])
    return out


def _serve(rank: int, world: int, hf_config, state_dict, prompts, kv_cache_dtype: str, dcp: int,
           kv_scales: dict[int, KVScales] | None, lowering: str) -> dict:
    """One rank: the engine over a quantised cache; tokens, logits, capacity, pass history, written scales."""
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=dcp, block_size=BLOCK,
                              kv_cache_dtype=kv_cache_dtype)
    if world * dcp > 1:
        cp_compile.init_parallel(cfg, device="cpu")
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(hf_config)).eval()
    model.load_state_dict(state_dict)
    model.generation_config.eos_token_id = None
    engine = cp_compile.serving.hf.Engine(model, cfg, num_blocks=NUM_BLOCKS, lowering=lowering,
                                          forbid_recompiles=True, record_logits=True, progress=False,
                                          kv_scales=kv_scales)
    tokens = engine.generate(prompts, max_new_tokens=MAX_NEW, arrivals=ARRIVALS)
    return dict(tokens=tokens, logits=[torch.stack(engine.last_logits[i]) for i in range(len(prompts))],
                capacity=engine.capacity(), graphs=engine.num_graphs,
                history=[(h.name, h.rewrites) for h in engine.compiled.backend.pass_managers[0].history],
                written=_written_scales(engine), page_dtype=engine.cache.layers[0][0].dtype)


def _static(hf_config) -> dict[int, KVScales]:
    """Per-layer static scales small enough that some codes clamp (far from the dynamic ones)."""
    return {i: KVScales(0.002 + 0.001 * i, 0.003 + 0.001 * i, f"model.layers.{i}.self_attn.k_scale",
                        f"model.layers.{i}.self_attn.v_scale") for i in range(hf_config.num_hidden_layers)}


DCP_CASES = [
    # model, KV heads, kv_cache_dtype, static scales
    pytest.param("qwen3", 1, "int8", False, id="qwen3-int8"),
    pytest.param("qwen3", 1, "fp8_e4m3", True, id="qwen3-fp8-static", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 4, "fp8_e4m3", False, id="deepseek_v3-mla-fp8", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 4, "int8", True, id="deepseek_v3-mla-int8-static-unused", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 4, "fp8_e4m3", True, id="deepseek_v3-mla-fp8-static", marks=pytest.mark.slow),
    # SFA (DeepSeek-V3.2: sparse MLA over the quantised latent, the indexer cache unquantised; decision 69)
    pytest.param("deepseek_v32", 0, "int8", False, id="deepseek_v32-sfa-int8", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,kv_heads,kv_cache_dtype,static", DCP_CASES)
def test_hf_engine_quantised_tp2_dcp2_matches_one_device(kind, kv_heads, kv_cache_dtype, static):
    if kind == "deepseek_v32":
        from examples.models.tiny_seed import tiny_seed_model

        hf = tiny_seed_model(kind)
    else:
        hf = tiny_hf(kind, num_kv_heads=kv_heads)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    prompts = _prompts()
    scales = _static(hf.config) if static else None
    t0 = time.time()
    outs = run_on_ranks(_serve, 2, copy.deepcopy(hf.config), sd, prompts, kv_cache_dtype, 2, scales, "eager",
                        timeout=900)
    wall = time.time() - t0
    ref = _serve(0, 1, copy.deepcopy(hf.config), sd, prompts, kv_cache_dtype, 1, scales, "eager")
    layers = hf.config.num_hidden_layers
    worst = 0.0
    for rank, out in enumerate(outs):
        dcp_pass = "sfa_dcp" if kind == "deepseek_v32" else "dcp_attention"
        assert dict(out["history"])[dcp_pass] == layers, out["history"]
        assert out["graphs"] == 1
        assert out["page_dtype"] == ref["page_dtype"] == cp_compile.base.config.KV_CACHE_DTYPES[kv_cache_dtype]
        for i in range(len(prompts)):
            assert out["tokens"][i] == ref["tokens"][i], f"rank {rank} prompt {i}"
            torch.testing.assert_close(out["logits"][i], ref["logits"][i], atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"rank {rank} prompt {i}: {m}")
            worst = max(worst, (out["logits"][i] - ref["logits"][i]).abs().max().item())
        cap = out["capacity"]
        # Same blocks per rank as the one device (pages and scales), twice the tokens per group.
        assert cap["kv_scale_bytes_per_rank"] == ref["capacity"]["kv_scale_bytes_per_rank"] > 0
        assert cap["kv_bytes_per_rank"] == ref["capacity"]["kv_bytes_per_rank"]
        assert cap["tokens_per_group"] == 2 * ref["capacity"]["tokens_per_group"]
        for layer, (got, want) in enumerate(zip(out["written"], ref["written"])):
            for g, w in zip(got, want):
                assert g.numel() > 0
                if static and kv_cache_dtype == "fp8_e4m3":  # every written scale is the layer's static one
                    s = scales[layer]
                    allowed = {s.k} if kind == "deepseek_v3" else {s.k, s.v}
                    assert set(torch.unique(g).tolist()) <= {torch.tensor(a).float().item() for a in allowed}
    print(f"\nHF QUANT {kind} {kv_cache_dtype}{' static' if static else ''} tp=2 dcp=2: max|dlogit| vs one device "
          f"{worst:.2e}, tokens equal; KV/rank {outs[0]['capacity']['kv_bytes_per_rank']} B of which scales "
          f"{outs[0]['capacity']['kv_scale_bytes_per_rank']} B; wall {wall:.0f}s")


# ---- static scales from a checkpoint ------------------------------------------------------------


def _fake_quant(x: torch.Tensor, s: float) -> torch.Tensor:
    """x stored as fp8_e4m3 with scale s and read back (the cache's arithmetic, written independently)."""
    return ((x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s).to(x.dtype)


def _hf_static_reference(hf, scales: dict[int, tuple[float, float]], prompts, max_new):
    """HF's generate (its own cache, sdpa attention) with every K / V fake-quantised by the layer's
    static scales; tokens and per-token logits."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kw):
        ks, vs = scales[module.layer_idx]
        return sdpa_attention_forward(module, query, _fake_quant(key, ks), _fake_quant(value, vs), attention_mask,
                                      **kw)

    transformers.AttentionInterface.register("cp_test_static_fq", attention)
    model = copy.deepcopy(hf)
    model.config._attn_implementation = "cp_test_static_fq"
    toks, logits = [], []
    for p, n in zip(prompts, max_new):
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        toks.append(out.sequences[0, len(p):].tolist())
        logits.append(torch.cat(out.logits).float())
    return toks, logits


def _save_with_scales(hf, path, tensors: dict[str, torch.Tensor]) -> None:
    """save_pretrained (safetensors), then the scale tensors added to its model.safetensors."""
    from safetensors.torch import load_file, save_file

    hf.save_pretrained(path)
    f = os.path.join(path, "model.safetensors")
    sd = load_file(f)
    sd.update(tensors)
    save_file(sd, f, metadata={"format": "pt"})


def _scale_tensors(n_layers: int, k: list[float], v: list[float]) -> dict[str, torch.Tensor]:
    return {**{f"model.layers.{i}.self_attn.k_scale": torch.tensor(k[i]) for i in range(n_layers)},
            **{f"model.layers.{i}.self_attn.v_scale": torch.tensor(v[i]) for i in range(n_layers)}}


def test_checkpoint_static_kv_scales_load_and_are_used(tmp_path, capfd):
    hf = tiny_hf("qwen3", num_kv_heads=1)
    n = hf.config.num_hidden_layers
    k = [0.002 + 0.001 * i for i in range(n)]  # small: many codes clamp, far from the dynamic amax scales
    v = [0.003 + 0.001 * i for i in range(n)]
    _save_with_scales(hf, str(tmp_path), _scale_tensors(n, k, v))
    args = EngineArgs(model=str(tmp_path), kv_cache_dtype="fp8_e4m3", block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                      max_num_seqs=4, lowering="aot_eager")
    args.validate()
    engine = build_engine(args)
    report = capfd.readouterr().out
    assert "from the checkpoint, 2 layers (fp8_e4m3)" in report, report
    assert "fp8_e4m3 pages" in report and "fp32 scales" in report, report
    f32 = [torch.tensor(x).item() for x in k], [torch.tensor(x).item() for x in v]  # the fp32 values
    assert scales_of(engine.model) == {i: {"k_static_scale": f32[0][i], "v_static_scale": f32[1][i]}
                                       for i in range(n)}
    engine.record_logits = True
    prompts = _prompts()
    tokens = engine.generate(prompts, max_new_tokens=MAX_NEW)
    for i, (ks, vs) in enumerate(_written_scales(engine)):  # every stored scale is the static one
        assert ks.numel() > 0 and torch.equal(ks, torch.full_like(ks, f32[0][i])), (i, torch.unique(ks))
        assert torch.equal(vs, torch.full_like(vs, f32[1][i])), (i, torch.unique(vs))
    ref_tokens, ref_logits = _hf_static_reference(hf, {i: (f32[0][i], f32[1][i]) for i in range(n)}, prompts,
                                                  MAX_NEW)
    for i in range(len(prompts)):
        assert tokens[i] == ref_tokens[i], f"prompt {i}"
        torch.testing.assert_close(torch.stack(engine.last_logits[i]), ref_logits[i], atol=1e-4, rtol=1e-4)


def test_checkpoint_scales_with_int8_are_not_used(tmp_path, capfd):
    hf = tiny_hf("qwen3", num_kv_heads=1, num_layers=1)
    _save_with_scales(hf, str(tmp_path), _scale_tensors(1, [0.002], [0.003]))
    args = EngineArgs(model=str(tmp_path), kv_cache_dtype="int8", block_size=BLOCK, num_kv_blocks=8,
                      max_num_seqs=2, lowering="eager")
    engine = build_engine(args)
    assert "are not used: kv_cache_dtype='int8' keeps dynamic per-token scales" in capfd.readouterr().out
    assert scales_of(engine.model) == {}


@pytest.mark.parametrize("tensors,match", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor(-0.5)},
     r"positive and finite.*model.layers.0.self_attn.k_scale = -0.5"),
    ({"model.layers.0.self_attn.k_scale": torch.tensor(float("nan"))},
     r"positive and finite.*model.layers.0.self_attn.k_scale = nan"),
    ({"model.layers.0.self_attn.v_scale": torch.tensor([0.1, 0.2])},
     r"one scalar per layer.*model.layers.0.self_attn.v_scale: shape \[2\]"),
])
def test_malformed_checkpoint_scale_refused_naming_the_tensor(tmp_path, tensors, match):
    hf = tiny_hf("qwen3", num_kv_heads=1, num_layers=1)
    good = _scale_tensors(1, [0.01], [0.01])
    _save_with_scales(hf, str(tmp_path), {**good, **tensors})
    with pytest.raises(ConfigError, match=match):
        read_kv_scales(str(tmp_path), 1)
    with pytest.raises(ConfigError, match=match):  # EngineArgs.validate: before any rank starts
        EngineArgs(model=str(tmp_path), kv_cache_dtype="fp8_e4m3", block_size=BLOCK).validate()


def test_checkpoint_scales_of_some_layers_refused(tmp_path):
    hf = tiny_hf("qwen3", num_kv_heads=1, num_layers=2)
    _save_with_scales(hf, str(tmp_path), _scale_tensors(1, [0.01], [0.01]))  # layer 1 has none
    with pytest.raises(ConfigError, match=r"layers \[1\] have no k_scale / v_scale"):
        read_kv_scales(str(tmp_path), 2)


# ---- the front doors and the start-up report ----------------------------------------------------


def test_kv_cache_dtype_through_engine_args_llm_and_cli(tmp_path):
    hf = tiny_hf("qwen3", num_kv_heads=1, num_layers=1)
    hf.save_pretrained(tmp_path)
    assert EngineArgs(model=str(tmp_path), kv_cache_dtype="int8").cp_config().kv_cache_dtype == "int8"
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8'. Fix: vLLM's 'fp8' \(e4m3\) is 'fp8_e4m3' here"):
        EngineArgs(model=str(tmp_path), kv_cache_dtype="fp8").validate()
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp16'. Fix: use 'auto'"):
        EngineArgs(model=str(tmp_path), kv_cache_dtype="fp16").validate()
    with pytest.raises(ConfigError, match=r"kv_cache_dtype='fp8'"):  # LLM validates before anything starts
        cp_compile.LLM(model=str(tmp_path), kv_cache_dtype="fp8")
    ns = cli._parser().parse_args(["serve", str(tmp_path), "--kv-cache-dtype", "fp8_e4m3"])
    assert ns.kv_cache_dtype == "fp8_e4m3"


@pytest.mark.parametrize("kind,kv_cache_dtype", [("qwen3", "int8"), ("deepseek_v3", "fp8_e4m3")])
def test_startup_report_counts_the_scale_bytes(kind, kv_cache_dtype):
    """The pool's block bytes include the scales (so the capacity does), and the report prints them
    apart; both checked against the config's own arithmetic."""
    from cp_compile.serving.hf.kv_budget import bytes_per_block, scale_bytes_per_block

    hf = tiny_hf(kind, num_kv_heads=2)
    c = hf.config
    cfg = cp_compile.CPConfig(block_size=BLOCK, kv_cache_dtype=kv_cache_dtype)
    if kind == "deepseek_v3":
        pages, scales = c.kv_lora_rank + c.qk_rope_head_dim, 4  # one latent row and one fp32 scale per token
    else:
        pages, scales = 2 * c.num_key_value_heads * c.head_dim, 2 * c.num_key_value_heads * 4
    per_block = BLOCK * c.num_hidden_layers
    assert scale_bytes_per_block(cfg, c, torch.float32) == scales * per_block
    block = bytes_per_block(cfg, c, torch.float32)
    assert block == (pages + scales) * per_block
    budget = 10 * block + 7
    pool = plan_pool(cfg, block, 32, 4, kv_cache_memory_bytes=budget,
                     block_scale_bytes=scale_bytes_per_block(cfg, c, torch.float32))
    assert pool.num_blocks == 10  # the scales take their share of the budget
    line = pool.lines()[0]
    assert (f"({kv_cache_dtype} pages {pages * per_block:,d} B + fp32 scales {scales * per_block:,d} B per block; "
            f"per token {pages * c.num_hidden_layers:,d} + {scales * c.num_hidden_layers:,d} B)") in line, line
    auto = plan_pool(cp_compile.CPConfig(block_size=BLOCK), block, 32, 4, num_blocks=10)
    assert "scales" not in auto.lines()[0]


def test_static_scales_with_pcp_refused():
    hf = tiny_hf("qwen3", num_kv_heads=1, num_layers=1)
    cfg = cp_compile.CPConfig(prefill_context_parallel_size=2, kv_cache_dtype="fp8_e4m3", block_size=BLOCK)
    with pytest.raises(ConfigError, match=r"static KV scales are served at prefill_context_parallel_size = 1"):
        cp_compile.serving.hf.Engine(hf, cfg, num_blocks=4, kv_scales=_static(hf.config),
                                     parallel=object())  # refused before the parallel state is read


def test_llm_with_a_quantised_cache_equals_the_engine(tmp_path):
    """`LLM(..., kv_cache_dtype="int8")` (tiny DeepSeek-V2-Lite: MLA + MoE, its own tokenizer, in
    this process) serves from int8 pages and gives the greedy tokens of the engine over the same
    checkpoint with the same int8 cache."""
    from cp_compile import LLM, SamplingParams
    from cp_compile.serving.hf.rank_load import load_rank_local
    from examples.models.tiny_seed import save_checkpoint, tiny_seed_model

    path = save_checkpoint(tiny_seed_model("deepseek_v2_lite"), str(tmp_path / "ckpt"))
    prompts = [[5, 9, 14, 3, 22], [7, 8, 30]]
    with LLM(model=path, block_size=BLOCK, lowering="eager", max_model_len=64, kv_cache_dtype="int8") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        served = llm.executor.engine
        assert served.cache.layers[0][0].dtype == torch.int8 and served.capacity()["kv_scale_bytes_per_rank"] > 0
    cfg = cp_compile.CPConfig(block_size=BLOCK, kv_cache_dtype="int8")
    torch._dynamo.reset()  # the reference compiles the same model code afresh (the LLM is closed)
    ref = cp_compile.serving.hf.Engine(load_rank_local(path), cfg, num_blocks=NUM_BLOCKS, lowering="eager",
                                       eos_token_id=None, progress=False)
    assert [o.outputs[0].token_ids for o in outs] == ref.generate(prompts, max_new_tokens=8)
