"""The seeds' models (MoE: DeepSeek-V2-Lite / V3 shapes, Qwen3-MoE) loaded from a
saved safetensors directory and served by `cp_compile.serving.hf.Engine` under TP / DCP /
PCP on gloo ranks: greedy tokens equal HF's own `generate`, logits within fp32
tolerance, one graph per batch kind (recompiles forbidden after warm-up).

The wide model x layout table is `slow` (`-m slow`); its output is in
docs/hf.md. The default case covers MoE + SFA (DeepSeek-V3.2) under TP + DCP; PCP in
the Engine is covered by default in tests/entrypoints/test_llm.py (spawned PCP ranks
equal the in-process run, which equals HF's generate).
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import cp_compile
import cp_compile.serving.hf
from cp_compile.serving.hf import moe
from cp_compile.serving.hf.moe import AllReduceOutput
from examples import seed_parity
from examples.models.tiny_seed import save_checkpoint, tiny_seed_model

CASES = [
    # kind, tp, dcp, pcp, interleave, lowering, dsa_cp, expected graphs (pcp 2: decode, fresh prefill, prefill)
    pytest.param("deepseek_v32", 2, 2, 1, 1, "aot_eager", False, 1, id="deepseek_v32-moe-sfa-tp2-dcp2"),
    pytest.param("deepseek_v2_lite", 2, 2, 2, 1, "aot_eager", False, 3, id="deepseek_v2_lite-tp2-dcp2-pcp2",
                 marks=pytest.mark.slow),
    pytest.param("deepseek_v2_lite", 2, 2, 1, 1, "inductor", False, 1, id="deepseek_v2_lite-tp2-dcp2-inductor",
                 marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 2, 2, 1, 1, "aot_eager", False, 1, id="deepseek_v3-moe-tp2-dcp2", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 2, 1, 2, 1, "aot_eager", False, 3, id="deepseek_v3-tp2-pcp2", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 1, 1, 2, 1, "eager", False, 3, id="qwen3_moe-pcp2", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 2, 2, 1, 1, "inductor", False, 1, id="qwen3_moe-tp2-dcp2-inductor", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", 2, 2, 2, 4, "aot_eager", False, 3, id="qwen3_moe-tp2-dcp2-pcp2-il4", marks=pytest.mark.slow),
    pytest.param("glm5", 2, 2, 1, 1, "aot_eager", False, 1, id="glm5-tp2-dcp2", marks=pytest.mark.slow),
    pytest.param("deepseek_v32", 2, 1, 1, 1, "aot_eager", True, 2, id="deepseek_v32-tp2-dsa_cp", marks=pytest.mark.slow),
    pytest.param("glm5", 2, 1, 1, 1, "aot_eager", True, 2, id="glm5-tp2-dsa_cp", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("kind,tp,dcp,pcp,interleave,lowering,dsa_cp,graphs", CASES)
def test_seed_model_matches_hf_generate(kind, tp, dcp, pcp, interleave, lowering, dsa_cp, graphs):
    res = seed_parity.run(kind, tp, dcp, pcp, interleave, lowering, dsa_cp)
    print("\n" + seed_parity.row(res))
    assert res["tokens_equal"], res
    assert res["max_logit_diff"] < 1e-4, res
    assert res["graphs"] == graphs, res
    cap = res["capacity"]
    assert cap["kv_bytes_per_rank"] * dcp * pcp == cap["kv_bytes_per_rank_dcp1"]


def test_moe_routing_differs_between_tokens_and_shards_exactly(tmp_path):
    """One device, the TP plan applied with tp = 2 by hand on two copies: the two
    ranks' partial outputs of a MoE block sum to HF's block output; tokens route to
    more than the top-k experts in total (the routing is exercised, not constant)."""
    model = tiny_seed_model("deepseek_v3")
    block = model.model.layers[1].mlp
    x = torch.randn(1, 9, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = block(x)
        _, _, idx = block.gate(x)
    assert idx.unique().numel() > model.config.num_experts_per_tok
    model.config._experts_implementation = "batched_mm"
    parts = []
    for rank in range(2):
        shard = copy.deepcopy(block)
        moe._shard_experts(shard.experts, torch.arange(rank * 16, (rank + 1) * 16))
        moe._shard_dense_partial(shard.shared_experts, 2, rank)
        with torch.no_grad():
            parts.append(shard(x))
    torch.testing.assert_close(parts[0] + parts[1], ref, atol=1e-5, rtol=1e-5)
    assert (parts[0] - ref).abs().max() > 1e-2  # one shard alone is not the answer


def test_checkpoint_loads_from_disk_and_moe_blocks_are_wrapped(tmp_path):
    path = save_checkpoint(tiny_seed_model("qwen3_moe"), str(tmp_path / "ckpt"))
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = cp_compile.serving.hf.Engine(model, cp_compile.CPConfig(block_size=4), num_blocks=8, lowering="eager")
    assert model.config._experts_implementation == "batched_mm"
    assert engine.kind == "gqa"
    # tp = 1: nothing sharded, nothing wrapped
    assert not any(isinstance(layer.mlp, AllReduceOutput) for layer in model.model.layers)
