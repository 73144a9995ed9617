"""The `mla_preprocess` pass (MLAPO) at model level: fused == unfused.

Each world compiles the same TP-sharded example model twice, with
`enable_mla_preprocess` off and on, runs the same greedy schedule (prefill, decodes,
a request joining mid-way beside decodes, one leaving, padding tokens) through both,
and requires, on every rank: equal last-token logits (fp32 1e-5; W8A8 bit for bit
under aot_eager, where both graphs run the same int32 reference kernels) and equal
greedy tokens; no recompile after the warm-up steps; and every MLA layer of every
graph rewritten (the pass's count == num_layers), with the latent cache write
folded into the op where the graph writes the op's own latent.

Default suite: one-device structure (example MLA bf16; HF DeepSeek-V3 both ropes and V2
through `cp_compile.serving.hf`) and tp = dcp = 2. `slow`: W8A8 and SFA on one device, HF
DeepSeek-V3.2 / GLM-5 through `cp_compile.serving.hf`, dcp 4, pcp 2, DSA-CP, SFA DCP, W8A8 under
DCP, Inductor (docs/mla_preprocess.md lists the run).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cp_compile
from cp_compile.testing.multirank import run_on_ranks
from examples.models.deepseek_mla import DeepseekMLAConfig, DeepseekMLAModel
from examples.models.deepseek_sfa import DeepseekSFAConfig, DeepseekSFAModel
from examples.models.tiny import VOCAB, hf_deepseek_sfa, hf_deepseek_v2_lite, hf_deepseek_v3
from examples.serving import layer_caches, run_schedule, tiny_schedule
from tools.mla_preprocess_hf_matches import hf_engine_pair, rewrites

BLOCK = 4
NUM_BLOCKS = 12
STEPS = 6
WARMUP = 2
LAYERS = 2


def build(hf_config, state_dict, tp: int = 1, tp_rank: int = 0, tp_group=None, quant: bool = False):
    """The example model of `hf_config` (MLA or SFA), W8A8 MLA projections when `quant`."""
    sfa = hf_config.model_type in ("deepseek_v32", "glm_moe_dsa")
    cfg = (DeepseekSFAConfig if sfa else DeepseekMLAConfig).from_hf(hf_config)
    cfg = dataclasses.replace(cfg, mla_quant=True if quant else None)
    model = (DeepseekSFAModel if sfa else DeepseekMLAModel)(cfg, tp, tp_rank, tp_group)
    model.load_hf_state_dict(state_dict)
    return model.eval()


def _count(hist: dict[str, int], name: str) -> int:
    return hist.get(name, 0) + hist.get(name + ".default", 0)


def run_pair(rank: int, world: int, hf_config, state_dict, cfg_kwargs: dict, quant: bool,
             lowering: str, dtype: torch.dtype = torch.float32) -> dict:
    """Off, then on: logits per step, pass records per graph."""
    out = {}
    for on in (False, True):
        cfg = cp_compile.CPConfig(block_size=BLOCK, enable_mla_preprocess=on, **cfg_kwargs)
        state = cp_compile.init_parallel(cfg, device="cpu") if world > 1 else None
        model = build(hf_config, state_dict, cfg.tensor_parallel_size, state.layout.tp.rank if state else 0,
                      state.tp_group if state else None, quant).to(dtype)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, dtype=dtype,
                                             attention=model.attention_spec())
        torch._dynamo.reset()
        compiled = cp_compile.compile_model(model, lowering=lowering, config=None if state else cfg)

        def stance(step: int, meta) -> None:
            if step == WARMUP - 1:
                torch.compiler.set_stance("fail_on_recompile")

        try:
            res = run_schedule(compiled, layer_caches(cache), cfg, NUM_BLOCKS,
                               tiny_schedule(VOCAB, num_steps=STEPS), on_step=stance)
        finally:
            torch.compiler.set_stance("default")
        graphs = [[(h.name, h.rewrites, h.before, h.after) for h in pm.history]
                  for b in compiled.backends.values() for pm in b.pass_managers]
        out[on] = dict(logits=[r.last_logits for r in res], tokens=[r.next_tokens for r in res], graphs=graphs,
                       cache=[[t.clone() for t in layer] for layer in cache.layers])
        if state is not None:
            cp_compile.destroy_parallel()
    return out


def check_pair(res: dict, quant: bool, lowering: str, folded: bool = True, tol: float = 1e-5) -> list[dict]:
    off, on = res[False], res[True]
    assert on["tokens"] == off["tokens"]
    for a, b in zip(on["logits"], off["logits"]):
        if quant and lowering == "aot_eager":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    records = []
    for graph in on["graphs"]:
        rec = {name: (n, before, after) for name, n, before, after in graph}
        n, before, after = rec["mla_preprocess"]
        assert n == LAYERS, f"{n} of {LAYERS} MLA layers rewritten"
        assert _count(after, "cp.mla_preprocess") == LAYERS
        writes = rec["mla_preprocess_cache_write"][0]
        records.append(dict(rewrites=n, writes_folded=writes, ops_before=sum(before.values()),
                            ops_after=sum(rec["mla_preprocess"][2].values())))
        if folded:
            assert writes == LAYERS
    for graph in off["graphs"]:
        assert all(name != "mla_preprocess" for name, *_ in graph)
    return records


# ----------------------------------------------------------------------------- one device


# W8A8 one device is `slow` (default-suite time, issue 27): the op equals the unfused W8A8
# projections bit for bit in tests/ops/test_mla_preprocess.py. The float q-LoRA pair is `slow`
# too (session 4): its paths stay in the default suite elsewhere: one device under aot_eager
# with the fold into cp::mla_partial_attention (the bf16 test below), q-LoRA one device (HF
# v3-interleave), q-LoRA under aot_eager (test_dcp2_fused_equals_unfused).
@pytest.mark.parametrize("kind,quant", [pytest.param("mla", False, marks=pytest.mark.slow),
                                        pytest.param("mla", True, marks=pytest.mark.slow),
                                        pytest.param("sfa", False, marks=pytest.mark.slow)])
def test_one_device_fused_equals_unfused(kind, quant):
    hf = hf_deepseek_v3(q_lora_rank=24, num_layers=LAYERS) if kind == "mla" else hf_deepseek_sfa(num_layers=LAYERS)
    res = run_pair(0, 1, hf.config, hf.state_dict(), {}, quant, "aot_eager")
    check_pair(res, quant, "aot_eager")


def test_one_device_bf16_fused_equals_unfused():
    """A bf16 model: the rms-norm / rope casts are matched in bf16 too (every layer rewritten),
    logits within bf16's tolerance."""
    hf = hf_deepseek_v3(q_lora_rank=None, num_layers=LAYERS)
    check_pair(run_pair(0, 1, hf.config, hf.state_dict(), {}, False, "aot_eager", torch.bfloat16), False,
               "aot_eager", tol=2e-2)


def check_quantised_cache(res: dict, kv_dtype: str) -> None:
    """The fused graphs write the latent through `cp::mla_preprocess_quant` (every layer; no
    `cp::quant_cache_write` / `cp::mla_attention_quant` left) and leave the same codes (bytes)
    and scales in the cache as the unfused quantised graphs."""
    for graph in res[True]["graphs"]:
        after = {name: a for name, _, _, a in graph}["mla_preprocess_cache_write"]
        assert _count(after, "cp.mla_preprocess_quant") == LAYERS, after
        assert not _count(after, "cp.quant_cache_write") and not _count(after, "cp.mla_attention_quant"), after
    dtype = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_dtype]
    for on_layer, off_layer in zip(res[True]["cache"], res[False]["cache"], strict=True):
        (codes_on, scales_on), (codes_off, scales_off) = on_layer, off_layer
        assert codes_on.dtype == dtype and torch.equal(codes_on.view(torch.uint8), codes_off.view(torch.uint8))
        torch.testing.assert_close(scales_on, scales_off, atol=0, rtol=1e-6)
        assert (scales_on > 0).any()


@pytest.mark.parametrize("kv_dtype", [pytest.param("int8", marks=pytest.mark.slow), "fp8_e4m3"])
def test_one_device_quantised_cache_fused_equals_unfused(kv_dtype):
    """MLAPO over a quantised latent cache (issue 39, decision 72): the fused op writes codes + per-token
    scales as `cp::quant_cache_write` does; logits fp32 1e-5, tokens equal, the caches equal."""
    hf = hf_deepseek_v3(q_lora_rank=24, num_layers=LAYERS)
    res = run_pair(0, 1, hf.config, hf.state_dict(), dict(kv_cache_dtype=kv_dtype), False, "aot_eager")
    check_pair(res, False, "aot_eager")
    check_quantised_cache(res, kv_dtype)


def test_hf_static_kv_scales_keep_the_latent_write_unfused():
    """A checkpoint's static fp8 scale (decision 71) rides on `cp::mla_attention_quant`; the fused
    MLAPO write stores dynamic scales only, so the pass must leave that write unfused (the op itself
    still rewritten): fused == unfused to fp32 1e-5, the same greedy tokens. Folded anyway, the
    latent would be written with dynamic scales and the logits would move."""
    from cp_compile.serving.hf.kv_scales import KVScales

    hf = hf_deepseek_v3(q_lora_rank=24, num_layers=LAYERS)
    scales = {i: KVScales(0.004 + 0.001 * i, 0.005, f"model.layers.{i}.self_attn.k_scale",
                          f"model.layers.{i}.self_attn.v_scale") for i in range(LAYERS)}
    out = hf_engine_pair(hf, dict(kv_cache_dtype="fp8_e4m3"), engine_kwargs=dict(kv_scales=scales))
    on, off = out[True], out[False]
    assert rewrites(on, "mla_preprocess") == LAYERS and rewrites(on, "mla_preprocess_cache_write") == 0, on["hist"]
    assert on["tokens"] == off["tokens"]
    for a, b in zip(on["logits"], off["logits"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


HF_MODELS = {
    "v3-interleave": lambda: hf_deepseek_v3(q_lora_rank=24, num_layers=LAYERS),
    "v3-rotate_half": lambda: hf_deepseek_v3(q_lora_rank=24, num_layers=LAYERS, rope_interleave=False),
    "v3.2": lambda: hf_deepseek_sfa("deepseek_v32", num_layers=LAYERS),
    "glm-5": lambda: hf_deepseek_sfa("glm_moe_dsa", num_layers=LAYERS),
    "v2": lambda: hf_deepseek_v2_lite(),  # V2-Lite: q_proj; complex-number RoPE (freqs_cis)
    "v2-q_lora": lambda: hf_deepseek_v2_lite(q_lora_rank=24),
    "v2-bf16": lambda: hf_deepseek_v2_lite().to(torch.bfloat16),  # the op's interleave_fp32 rope
}
def check_hf_pair(out: dict, tol: float = 1e-5) -> None:
    """Every MLA layer rewritten (and its cache write folded), one graph per side (no recompiles),
    tokens equal, logits within fp32 `tol` of the unfused graph's."""
    off, on = out[False], out[True]
    assert rewrites(on, "mla_preprocess") == LAYERS and rewrites(on, "mla_preprocess_cache_write") == LAYERS, \
        on["hist"]
    assert not on["warnings"], on["warnings"]
    assert all(name != "mla_preprocess" for name, *_ in off["hist"])
    assert off["graphs"] == on["graphs"] == 1, (off["graphs"], on["graphs"])
    assert on["tokens"] == off["tokens"]
    for a, b in zip(on["logits"], off["logits"]):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", ["v3-interleave", "v3-rotate_half", "v2", "v2-bf16",
                                  pytest.param("v3.2", marks=pytest.mark.slow),
                                  pytest.param("glm-5", marks=pytest.mark.slow),
                                  pytest.param("v2-q_lora", marks=pytest.mark.slow)])
def test_hf_every_layer_rewritten(name):
    """Unmodified HF models through cp_compile.serving.hf (lowering eager: the passes run, the graph
    runs as FX): DeepSeek-V3 with its own projections and HF rope (interleaved pairs split into
    halves, or rotate_half over a cat((freqs, freqs)) table), the head layout, the dead per-head
    K; DeepSeek-V2 with its complex-number rope (view_as_complex x freqs_cis, view_as_real; in
    bf16 HF rotates in fp32: the op's interleave_fp32, bf16's tolerance);
    DeepSeek-V3.2 / GLM-5 through cp_compile/serving/hf/sfa.py (the query parts taken apart per head,
    the indexer reading q_resid)."""
    check_hf_pair(hf_engine_pair(HF_MODELS[name]()), tol=2e-2 if name.endswith("bf16") else 1e-5)


def _hf_rank(rank: int, world: int, name: str, dcp: int) -> dict:
    """One gloo rank: tp = world, dcp; the HF model rebuilt from the same seed on every rank."""
    return hf_engine_pair(HF_MODELS[name](), dict(tensor_parallel_size=world, decode_context_parallel_size=dcp),
                          parallel=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v2", "v2-q_lora"])
def test_hf_v2_dcp2_every_layer_rewritten(name):
    """HF DeepSeek-V2 at tp = dcp = 2 on gloo ranks: on every rank every layer rewritten (the
    op's outputs feed the DCP Q all-gather), the local write folded, fused == unfused."""
    for out in run_on_ranks(_hf_rank, 2, name, 2, timeout=900):
        check_hf_pair(out)
        assert rewrites(out[True], "dcp_attention") == rewrites(out[False], "dcp_attention") == LAYERS, \
            out[True]["hist"]


def test_hf_biased_projections_refused_with_reason():
    """HF DeepSeek-V2 / V3 with config.attention_bias=True (biased q_a_proj / kv_a_proj_with_mqa):
    the op's projections are bias-free, so the layers stay unfused (exact) and the warning names
    the biased projection and the config field; no layer is rewritten."""
    with pytest.warns(UserWarning, match=r"2 of 2 MLA attention layers.*kv_a_proj_with_mqa \(\S+\) has a bias"
                                         r".*attention_bias=True") as rec:
        out = hf_engine_pair(hf_deepseek_v2_lite(attention_bias=True))
    assert rewrites(out[True], "mla_preprocess") == 0, out[True]["hist"]
    assert out[True]["tokens"] == out[False]["tokens"]
    assert len(out[True]["warnings"]) == 1 and len(rec) >= 1


# ----------------------------------------------------------------------------- gloo ranks


def _mla_hf():
    return hf_deepseek_v3(q_lora_rank=24, num_layers=LAYERS, num_heads=8)


def _run(world: int, cfg_kwargs: dict, quant: bool = False, lowering: str = "aot_eager", kind: str = "mla",
         folded: bool = True) -> list[dict]:
    hf = _mla_hf() if kind == "mla" else hf_deepseek_sfa(num_layers=LAYERS, num_heads=8)
    per_rank = run_on_ranks(run_pair, world, hf.config, hf.state_dict(), cfg_kwargs, quant, lowering, timeout=900)
    return [check_pair(r, quant, lowering, folded) for r in per_rank]


def test_dcp2_fused_equals_unfused():
    _run(2, dict(tensor_parallel_size=2, decode_context_parallel_size=2))


@pytest.mark.slow
def test_dcp2_quantised_cache_fused_equals_unfused():
    """`-m slow` (~60 s, a spawned world). tp = dcp = 2 on gloo, fp8 latent: the DCP composition's local `cp::quant_cache_write` folds into
    `cp::mla_preprocess_quant`; each rank's logits, tokens and cache shard equal the unfused graph's."""
    hf = _mla_hf()
    per_rank = run_on_ranks(run_pair, 2, hf.config, hf.state_dict(),
                            dict(tensor_parallel_size=2, decode_context_parallel_size=2, kv_cache_dtype="fp8_e4m3"),
                            False, "aot_eager", timeout=900)
    for r in per_rank:
        check_pair(r, False, "aot_eager")
        check_quantised_cache(r, "fp8_e4m3")


@pytest.mark.slow
def test_pcp2_quantised_cache_fused_equals_unfused():
    """`-m slow` (~75 s). pcp 2 on gloo, int8 latent: the decode graph's write folds into
    `cp::mla_preprocess_quant`, the PCP prefill graphs keep their `cp::quant_cache_write` of the
    gathered latents; each rank's logits, tokens and cache (codes and scales) equal the unfused graph's."""
    hf = _mla_hf()
    per_rank = run_on_ranks(run_pair, 2, hf.config, hf.state_dict(),
                            dict(prefill_context_parallel_size=2, kv_cache_dtype="int8"), False, "aot_eager",
                            timeout=900)
    for r in per_rank:
        check_pair(r, False, "aot_eager", folded=False)
        for (codes_on, scales_on), (codes_off, scales_off) in zip(r[True]["cache"], r[False]["cache"], strict=True):
            assert torch.equal(codes_on, codes_off) and torch.equal(scales_on, scales_off)
        fused = [_count({n: a for n, _, _, a in g}["mla_preprocess_cache_write"], "cp.mla_preprocess_quant")
                 for g in r[True]["graphs"]]
        assert LAYERS in fused and 0 in fused, fused  # the decode graph folds, the prefill graphs do not


SLOW = [
    ("dcp1_tp2", 2, dict(tensor_parallel_size=2), False, "aot_eager", "mla", True),
    ("dcp4", 4, dict(tensor_parallel_size=4, decode_context_parallel_size=4), False, "aot_eager", "mla", True),
    ("dcp2_w8a8", 2, dict(tensor_parallel_size=2, decode_context_parallel_size=2), True, "aot_eager", "mla", True),
    ("dcp2_inductor", 2, dict(tensor_parallel_size=2, decode_context_parallel_size=2), False, "inductor", "mla",
     True),
    # PCP prefill graphs write the PCP-gathered latents: the write stays there (decode graphs fold it).
    ("pcp2", 2, dict(prefill_context_parallel_size=2), False, "aot_eager", "mla", False),
    ("sfa_dcp2", 2, dict(tensor_parallel_size=2, decode_context_parallel_size=2), False, "aot_eager", "sfa", True),
    ("dsa_cp_tp2", 2, dict(tensor_parallel_size=2, enable_dsa_cp=True), False, "aot_eager", "sfa", True),
]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,cfg_kwargs,quant,lowering,kind,folded", SLOW, ids=[s[0] for s in SLOW])
def test_matrix(name, world, cfg_kwargs, quant, lowering, kind, folded):
    records = _run(world, cfg_kwargs, quant, lowering, kind, folded)
    print(f"\nMLAPO {name}: per rank, per graph {records}")


def test_enabled_pass_that_matches_nothing_says_so():
    """No silent no-op (issue 19's rule): an MLA attention whose inputs are not the recognised
    pre-processing (here: graph inputs; in practice e.g. HF DeepSeek-V2's complex-number RoPE)
    leaves the layer unfused with a warning naming how many layers did not match."""
    import torch.fx as fx

    from cp_compile.passes.mla_preprocess import MLAPreprocessPass

    graph = fx.Graph()
    names = ("q_nope", "q_pe", "kv_c", "k_pe", "kv_cache", "slot_mapping", "block_table", "seq_lens", "qsl")
    args = [graph.placeholder(n) for n in names]
    graph.output(graph.call_function(torch.ops.cp.mla_attention.default, (*args, 0.125)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    with pytest.warns(UserWarning, match=r"1 of 1 MLA attention layers in this graph do not match"):
        assert MLAPreprocessPass(None)(gm) == 0
