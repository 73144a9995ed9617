"""The all-reduce fold (issue 37, decision 62): the DCP output merge folded into the TP
all-reduce after o_proj, exact on gloo ranks.

One spawned world (tp 2 / dcp 2) runs the compiled GQA (Qwen3), MLA (DeepSeek-V3) and SFA
(DeepSeek-V3.2: sparse MLA, decision 73) models over every batch kind
(tests/passes/test_project_before_merge.py's steps: prefill, chunked
prefill beside a decode, decode, a mixed batch, decode after a request left), teacher-forced,
against the single-device eager model (every token's logits, fp32 1e-4). The last (decode)
step's collectives are counted at dispatch: folded, the layer has no reduce-scatter /
all-to-all, one collective fewer than AG+RS (the formula; the slow test also runs the unfolded
graph beside it), and the bytes equal `merge_collectives(..., fold=True)`; the TP all-reduces
are unchanged. The refusals run in one
process on the matcher (tests/passes/test_allreduce_fold_match.py).
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile.base.comm_stats import merge_collectives
from cp_compile.testing.metered import metered
from cp_compile.testing.multirank import run_on_ranks
from cp_compile.serving.hf.gathered_weights import gathered_weight_bytes
from examples.models.tiny import example_from_config, hf_deepseek_sfa, hf_deepseek_v3, hf_qwen3
from examples.serving import layer_caches
from tests.passes.test_project_before_merge import BLOCK, NUM_BLOCKS, PAD, STEPS, _reference, run_steps

TP = DCP = 2


def _world(rank: int, world: int, models: dict, cases: list[tuple]) -> list[dict]:
    results = []
    for kind, merge, fold, lowering, *project in cases:  # project: "off" unless a fifth field says
        hf_config, sd = models[kind]
        cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=DCP, block_size=BLOCK,
                                  dcp_merge=merge, dcp_merge_fold=fold,
                                  dcp_project_before_merge=(project or ["off"])[0])
        state = cp_compile.init_parallel(cfg, device="cpu")
        model = example_from_config(hf_config, sd, world, state.layout.tp.rank, state.tp_group)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
        compiled = cp_compile.compile_model(model, lowering=lowering)
        slot = metered(compiled)
        logits = run_steps(compiled, layer_caches(cache), BLOCK * DCP, slot)
        pms = compiled.backend.pass_managers
        results.append(dict(logits=logits, graphs=len(pms), lowering=lowering, tp=world, sent=dict(slot.meter.sent),
                            calls=dict(slot.meter.calls),
                            history={h.name: (h.rewrites, h.before, h.after, h.decision) for h in pms[0].history}))
        cp_compile.destroy_parallel()
        torch._dynamo.reset()
    return results


def _models() -> dict:
    out = {}
    for kind, hf in (("gqa", hf_qwen3(num_kv_heads=1)), ("mla", hf_deepseek_v3(q_lora_rank=None)),
                     ("sfa", hf_deepseek_sfa("deepseek_v32", num_heads=4))):
        out[kind] = (hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()})
    return out


def _sizes(kind: str, c, tp: int = TP) -> tuple[int, int, int]:
    """(heads per rank, q head dim, merged head dim) of the config."""
    h = c.num_attention_heads // tp
    if kind == "gqa":
        return h, c.head_dim, c.head_dim
    return h, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank


def check_fold(out: dict, ref: list[torch.Tensor], kind: str, hf_config, rank: int, unfolded: dict | None,
               merge: str = "ag_rs") -> None:
    assert out["graphs"] == 1, f"rank {rank}: {out['graphs']} graphs"
    for step, (got, want) in enumerate(zip(out["logits"], ref)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"rank {rank} step {step} ({kind} fold)")
    layers = hf_config.num_hidden_layers
    dcp_pass = "sfa_dcp" if kind == "sfa" else "dcp_attention"
    assert out["history"][dcp_pass][3]["fold"] is True, out["history"][dcp_pass][3]
    rw, before, after, decision = out["history"]["allreduce_fold"]
    assert rw == layers and decision["folded"] == layers
    tp = out["tp"]
    h, dq, dv = _sizes(kind, hf_config, tp)
    hidden = hf_config.hidden_size
    v_dim = hf_config.head_dim if kind == "gqa" else hf_config.v_head_dim
    # The other rank's o_proj columns [hidden, H*Dv] fp32, every layer (MLA: and its W_UV [H, L, Dv]).
    assert decision["gathered_o_proj_bytes"] == layers * (DCP - 1) * hidden * h * v_dim * 4
    if kind != "gqa":
        assert decision["gathered_projection_bytes"] == layers * (DCP - 1) * h * dv * v_dim * 4
    # What the HF engine charges against the KV budget before the first compile (decision 73):
    # the same bytes, from the model config alone.
    cfg = cp_compile.CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=DCP, dcp_merge_fold="on")
    assert gathered_weight_bytes(cfg, hf_config, torch.float32) == (
        decision["gathered_o_proj_bytes"] + decision["gathered_projection_bytes"])
    # The decode step, counted at dispatch: no output collective, the Q and LSE all-gathers only.
    T = sum(n for _, n in STEPS[-1].values()) + PAD
    assert "reduce_scatter" not in out["sent"] and "all_to_all" not in out["sent"], out["sent"]
    want = merge_collectives(T, h, dq, dv, 4, DCP, "replicate" if merge == "replicate" else "ag_rs", fold=True)
    assert out["sent"]["all_gather"] == layers * sum(b for _, b in want), out["sent"]
    assert out["calls"]["all_gather"] == layers * len(want)
    # One collective fewer per layer than AG+RS (its Q + LSE all-gathers + reduce-scatter; over
    # replicated queries the all-to-all is swapped for the LSE all-gather, as many); the TP
    # all-reduces (o_proj's, the MLP's) unchanged: 2 per layer, T x hidden fp32, ring bytes at tp 2.
    if merge != "replicate":
        assert out["calls"]["all_gather"] == layers * (len(merge_collectives(T, h, dq, dv, 4, DCP, "ag_rs")) - 1)
    if out["lowering"] != "inductor":  # Inductor's all-reduce is the in-place `all_reduce_`, which the meter skips
        assert out["calls"]["all_reduce"] == 2 * layers
        assert out["sent"]["all_reduce"] == 2 * layers * 2 * T * hidden * 4 * (tp - 1) // tp
    if unfolded is not None:  # one collective fewer per layer than AG+RS; the TP all-reduces unchanged
        assert sum(unfolded["calls"].values()) - sum(out["calls"].values()) == layers, (unfolded["calls"],
                                                                                       out["calls"])
        assert out["calls"]["all_reduce"] == unfolded["calls"]["all_reduce"]
        assert out["sent"]["all_reduce"] == unfolded["sent"]["all_reduce"]
        assert unfolded["sent"]["reduce_scatter"] > 0


CASES = [("gqa", "ag_rs", "on", "aot_eager"), ("mla", "a2a", "on", "aot_eager")]


# SFA DCP needs dcp == tp: at tp = dcp = 2 only (decision 73).
CASES_TP2 = CASES + [("sfa", "ag_rs", "on", "aot_eager")]


def test_allreduce_fold_tp2_dcp2_exact() -> None:
    """GQA, MLA and SFA (sparse MLA over the replicated indexer's top-k) folded at tp 2 / dcp 2,
    aot_eager, every batch kind (MLA asked with a2a: folded on the gathered queries)."""
    models = _models()
    per_rank = run_on_ranks(_world, TP, models, CASES_TP2, timeout=600)
    refs = {kind: _reference(c, sd, DCP) for kind, (c, sd) in models.items()}
    for rank, outs in enumerate(per_rank):
        for (kind, *_), out in zip(CASES_TP2, outs):
            check_fold(out, refs[kind], kind, models[kind][0], rank, None)


@pytest.mark.slow
def test_merge_algebra_sfa_both_rewrites() -> None:
    """SFA at tp = dcp = 2: folded over the a2a merge's gathered queries under Inductor, and
    projected before the a2a merge (aot_eager, the merge's bytes at Dv counted at dispatch),
    each exact against one device over every batch kind (decision 73)."""
    from tests.passes.test_project_before_merge import check_case

    models = _models()
    cases = [("sfa", "a2a", "on", "inductor"), ("sfa", "a2a", "off", "aot_eager", "on")]
    per_rank = run_on_ranks(_world, TP, {"sfa": models["sfa"]}, cases, timeout=900)
    c, sd = models["sfa"]
    ref = _reference(c, sd, DCP)
    for rank, (folded, projected) in enumerate(per_rank):
        check_fold(folded, ref, "sfa", c, rank, None, "a2a")
        hist = [(name, *v) for name, v in projected["history"].items()]
        check_case(dict(projected, history=hist), ref, c.num_hidden_layers, "a2a", True, rank, c)


@pytest.mark.slow
def test_allreduce_fold_inductor_and_replicate() -> None:
    """The same, lowered by Inductor (GQA and MLA), the fold over replicated queries
    (dcp_merge="replicate": no Q all-gather, the LSE all-gather is the layer's only DCP collective),
    and GQA side by side with its unfolded AG+RS graph (the counts compared run to run)."""
    models = _models()
    cases = [("gqa", "ag_rs", "on", "inductor"), ("mla", "ag_rs", "on", "inductor"),
             ("gqa", "replicate", "on", "aot_eager"), ("mla", "replicate", "on", "aot_eager"),
             ("gqa", "ag_rs", "off", "aot_eager"), ("gqa", "ag_rs", "on", "aot_eager")]
    per_rank = run_on_ranks(_world, TP, models, cases, timeout=900)
    refs = {kind: _reference(c, sd, DCP) for kind, (c, sd) in models.items()}
    for rank, outs in enumerate(per_rank):
        base = outs[4]
        for step, (got, want) in enumerate(zip(base["logits"], refs["gqa"])):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"rank {rank} step {step} (unfolded)")
        assert "allreduce_fold" not in base["history"]
        for i, ((kind, merge, *_), out) in enumerate(zip(cases, outs)):
            if i != 4:
                check_fold(out, refs[kind], kind, models[kind][0], rank, base if i == 5 else None, merge)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3", "deepseek_v3"])
def test_allreduce_fold_hf_engine(kind: str) -> None:
    """The HF engine's models (Qwen3 GQA; DeepSeek-V3 MLA, W_UV a slice of kv_b_proj.weight)
    folded ("on") at tp 2 / dcp 2, continuous batching (a join, a leave): tokens equal and
    logits within 1e-4 of HF's own single-device `generate`; every layer folded; the gathered
    o_proj columns counted in `Engine.capacity()`."""
    import copy

    from examples.hf_generate import hf_reference, serve, tiny_hf
    from tests.hf.test_hf_engine import ARRIVALS, BLOCK as HF_BLOCK, MAX_NEW, NUM_BLOCKS as HF_BLOCKS, _prompts

    hf = tiny_hf(kind, num_kv_heads=1 if kind == "qwen3" else 4)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    prompts = _prompts()
    outs = run_on_ranks(serve, 2, copy.deepcopy(hf.config), sd, prompts, MAX_NEW, 2, HF_BLOCK, HF_BLOCKS,
                        "aot_eager", ARRIVALS, config_kw={"dcp_merge_fold": "on"}, timeout=900)
    ref_tokens, ref_logits = hf_reference(hf, prompts, max(MAX_NEW))
    c = hf.config
    layers = c.num_hidden_layers
    for rank, out in enumerate(outs):
        assert dict(out["history"])["allreduce_fold"] == layers, out["history"]
        assert out["decisions"]["dcp_attention"]["fold"] is True
        assert out["capacity"]["gathered_weight_bytes_per_rank"] >= out["decisions"]["allreduce_fold"][
            "gathered_o_proj_bytes"] > 0
        for i in range(len(prompts)):
            n = MAX_NEW[i]
            assert out["tokens"][i] == ref_tokens[i][:n], f"rank {rank} prompt {i}"
            torch.testing.assert_close(out["logits"][i], ref_logits[i][:n], atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_allreduce_fold_tp4_dcp2() -> None:
    """tp 4 / dcp 2: two DCP groups inside one TP group (4 gloo ranks, 1 head per rank), so the
    TP all-reduce sums the two groups' folded partials as well as each group's ranks."""
    models = _models()
    per_rank = run_on_ranks(_world, 4, models, CASES, timeout=900)
    refs = {kind: _reference(c, sd, DCP) for kind, (c, sd) in models.items()}
    for rank, outs in enumerate(per_rank):
        for (kind, merge, *_), out in zip(CASES, outs):
            check_fold(out, refs[kind], kind, models[kind][0], rank, None, merge)
