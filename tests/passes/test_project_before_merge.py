"""Project before the merge (issue 37): MLA's W_UV moved before the DCP merge, exact on gloo ranks.

One spawned world runs several configs in turn (init_parallel / compile / destroy per
case, the process group shared): the compiled TP x DCP MLA model over steps of every
batch kind (prefill, chunked prefill beside a decode, decode, a mixed batch with a new
prompt, decode after a request left), teacher-forced, against the single-device eager
model (every token's logits, fp32 1e-4). The pass history shows the merges rebuilt on
projected partials: the merge moves the V head dim (the all-to-all / reduce-scatter
input 4x smaller at L = 4 Dv), the einsum count per layer stays one (on N*H heads).
The refusals (the pattern not provable) are checked in one process on the DCP pass's
matcher and through the pipeline.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile.base.comm_stats import CollectiveMeter, merge_collectives
from cp_compile.base.config import ConfigError
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.testing.metered import MeterSlot, metered
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_sfa, hf_deepseek_v3
from examples.serving import layer_caches

BLOCK = 4
NUM_BLOCKS = 16
PAD = 2
# (context, new tokens) per request id, per step: prefill; chunked prefill + decode; decode;
# mixed (a new prompt beside decodes); decode after request 1 left.
STEPS = [
    {0: (0, 5), 1: (0, 3)},
    {0: (5, 4), 1: (3, 1)},
    {0: (9, 1), 1: (4, 1)},
    {0: (10, 1), 1: (5, 1), 2: (0, 6)},
    {0: (11, 1), 2: (6, 1)},
]


def _hf(num_heads: int = 4, kind: str = "mla"):
    # The tiny configs' latent / V head dims: MLA 32 / 12, SFA (V3.2) latent 32 / 12.
    if kind == "sfa":
        return hf_deepseek_sfa("deepseek_v32", num_heads=num_heads)
    return hf_deepseek_v3(q_lora_rank=None, num_heads=num_heads)


def run_steps(forward, kv_layers, block_size: int, slot: MeterSlot | None = None) -> list[torch.Tensor]:
    """Every step's logits [T, vocab] (teacher-forced: fixed token ids, no sampling); the
    last step's collectives counted at dispatch in `slot.meter` where given."""
    alloc = BlockAllocator(NUM_BLOCKS, block_size)
    g = torch.Generator().manual_seed(7)
    out, live = [], set()
    for step in STEPS:
        for rid in live - set(step):
            alloc.free(rid)
        live = set(step)
        rids = sorted(step)
        meta = build_attention_metadata([step[r] for r in rids], alloc, req_ids=rids, num_padding_tokens=PAD,
                                        max_blocks_per_req=8)
        ids = torch.randint(0, VOCAB, (meta.num_tokens,), generator=g)
        if slot is not None and step is STEPS[-1]:
            slot.meter = CollectiveMeter()
        with torch.no_grad():
            out.append(forward(ids, meta.positions, kv_layers, meta).clone())
    return out


def _world(rank: int, world: int, cases: list[tuple], hf_config, state_dict) -> list[dict]:
    results = []
    for dcp, merge, project, lowering in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=dcp, block_size=BLOCK,
                                  dcp_merge=merge, dcp_project_before_merge=project)
        state = cp_compile.init_parallel(cfg, device="cpu")
        model = example_from_config(hf_config, state_dict, world, state.layout.tp.rank, state.tp_group)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
        compiled = cp_compile.compile_model(model, lowering=lowering)
        slot = metered(compiled)
        logits = run_steps(compiled, layer_caches(cache), BLOCK * dcp, slot)
        pms = compiled.backend.pass_managers
        results.append(dict(logits=logits, graphs=len(pms), sent=dict(slot.meter.sent), calls=dict(slot.meter.calls),
                            history=[(h.name, h.rewrites, h.before, h.after, h.decision) for h in pms[0].history]))
        cp_compile.destroy_parallel()
        torch._dynamo.reset()
    return results


def _reference(hf_config, state_dict, dcp: int) -> list[torch.Tensor]:
    model = example_from_config(hf_config, state_dict)
    cfg = cp_compile.CPConfig(block_size=BLOCK * dcp)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS)
    return run_steps(model, layer_caches(cache), BLOCK * dcp)


def _count(hist: dict[str, int], needle: str) -> int:
    return sum(v for k, v in hist.items() if needle in k)


def check_case(out: dict, ref: list[torch.Tensor], layers: int, merge: str, projected: bool, rank: int,
               hf_config=None, tp: int = 2, dcp: int = 2) -> None:
    assert out["graphs"] == 1, f"rank {rank}: {out['graphs']} graphs"
    for step, (got, want) in enumerate(zip(out["logits"], ref)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"rank {rank} step {step} ({merge})")
    hist = {name: (rw, before, after, decision) for name, rw, before, after, decision in out["history"]}
    dcp_decision = (hist.get("sfa_dcp") or hist["dcp_attention"])[3]
    assert bool(dcp_decision.get("project")) == projected, dcp_decision
    if not projected:
        assert "project_before_merge" not in hist
        return
    rw, before, after, decision = hist["project_before_merge"]
    assert rw == layers and decision["projected"] == rw
    if hf_config is not None:  # the last (decode) step's merge bytes, counted at dispatch
        assert out["sent"], "the meter counted no collective"
        c = hf_config
        T = sum(n for _, n in STEPS[-1].values()) + PAD
        want = merge_collectives(T, c.num_attention_heads // tp, c.kv_lora_rank + c.qk_rope_head_dim,
                                 c.v_head_dim, 4, dcp, merge)
        for kind in ("all_to_all", "reduce_scatter"):
            assert out["sent"].get(kind, 0) == layers * sum(b for k, b in want if k == kind), (kind, out["sent"])
    # The other rank's W_UV of every layer, gathered at compile time (fp32 [H, L, Dv] each).
    if hf_config is not None:
        c = hf_config
        h = c.num_attention_heads // tp
        assert decision["gathered_weight_bytes"] == layers * (dcp - 1) * h * c.kv_lora_rank * c.v_head_dim * 4
        assert decision["merged_head_dim"] == [c.kv_lora_rank, c.v_head_dim]
    # One W_UV einsum per layer before and after (moved onto the partial), the merge's collectives
    # rebuilt one for one, no leftover of the old merge.
    assert _count(before, "einsum") == _count(after, "einsum")
    for op in ("all_to_all_single", "reduce_scatter_tensor", "all_gather_into_tensor", "wait_tensor",
               "lse_combine", "lse_rescale"):
        assert _count(before, op) == _count(after, op), op


CASES_TP2 = [(2, "a2a", "on", "aot_eager"), (2, "ag_rs", "on", "aot_eager")]


def test_project_before_merge_mla_tp2_dcp2_exact() -> None:
    """a2a and ag_rs projected at tp 2 / dcp 2, every batch kind (unprojected: test_compiled_dcp_model.py)."""
    hf = _hf()
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    per_rank = run_on_ranks(_world, 2, CASES_TP2, hf.config, sd, timeout=600)
    ref = _reference(hf.config, sd, 2)
    for rank, outs in enumerate(per_rank):
        for (dcp, merge, project, _), out in zip(CASES_TP2, outs):
            check_case(out, ref, hf.config.num_hidden_layers, merge, project == "on", rank, hf.config)


@pytest.mark.slow
@pytest.mark.parametrize("tp,cases", [
    (4, [(2, "a2a", "on", "aot_eager"), (2, "ag_rs", "on", "aot_eager")]),
    (2, [(2, "a2a", "on", "inductor"), (2, "replicate", "on", "aot_eager")]),
    ("sfa", [(2, "a2a", "on", "aot_eager"), (2, "ag_rs", "on", "aot_eager")]),
])
def test_project_before_merge_mla_wide(tp: int | str, cases: list[tuple]) -> None:
    """tp 4 / dcp 2 (two DCP groups), Inductor, query replication + projection, SFA DCP at tp = dcp = 2."""
    kind = "sfa" if tp == "sfa" else "mla"
    tp = 2 if tp == "sfa" else tp
    hf = _hf(num_heads=8 if kind == "mla" else 4, kind=kind)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    per_rank = run_on_ranks(_world, tp, cases, hf.config, sd, timeout=900)
    ref = _reference(hf.config, sd, 2)
    for rank, outs in enumerate(per_rank):
        for (dcp, merge, project, _), out in zip(cases, outs):
            check_case(out, ref, hf.config.num_hidden_layers, merge, True, rank, hf.config, tp, dcp)


@pytest.mark.slow
def test_project_before_merge_hf_engine_mla() -> None:
    """The HF engine's MLA (W_UV a slice of kv_b_proj.weight: a view of a parameter) projected
    ("on") at tp 2 / dcp 2: greedy tokens and logits equal HF's own single-device generate."""
    import copy

    from examples.hf_generate import hf_reference, serve, tiny_hf
    from tests.hf.test_hf_engine import ARRIVALS, BLOCK as HF_BLOCK, MAX_NEW, NUM_BLOCKS as HF_BLOCKS, _prompts

    hf = tiny_hf("deepseek_v3", num_kv_heads=4)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    prompts = _prompts()
    outs = run_on_ranks(serve, 2, copy.deepcopy(hf.config), sd, prompts, MAX_NEW, 2, HF_BLOCK, HF_BLOCKS,
                        "aot_eager", ARRIVALS, config_kw={"dcp_project_before_merge": "on"}, timeout=900)
    ref_tokens, ref_logits = hf_reference(hf, prompts, max(MAX_NEW))
    layers = hf.config.num_hidden_layers
    for rank, out in enumerate(outs):
        assert dict(out["history"])["project_before_merge"] == layers, out["history"]
        assert out["decisions"]["dcp_attention"]["project"] is True
        for i in range(len(prompts)):
            n = MAX_NEW[i]
            assert out["tokens"][i] == ref_tokens[i][:n], f"rank {rank} prompt {i}"
            torch.testing.assert_close(out["logits"][i], ref_logits[i][:n], atol=1e-4, rtol=1e-4)
