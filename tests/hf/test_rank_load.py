"""Rank-local loading (cp_compile/serving/hf/rank_load.py) equals today's whole-load-then-shard
path on real gloo ranks at tp 2, for a dense GQA model (Qwen3, tied embeddings, bf16),
an MLA + SFA indexer + MoE model (DeepSeek-V3.2: routed + shared experts, router bias,
fp32) and a GQA MoE model (Qwen3-MoE, bf16), each saved with `save_pretrained` as a
multi-file checkpoint (model.safetensors.index.json).

Per rank and model: the same tensors (names, shapes, dtypes, values) as
`from_pretrained` + `shard_model`, and the same logits from HF's forward over the
sharded modules (their TP all-reduces on the gloo group; bf16 2e-2, fp32 1e-5); the
`slow` case also serves DeepSeek-V3.2 through `Engine` both ways (same greedy tokens
and logits). Bad checkpoints are refused by name.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

import cp_compile
import cp_compile.serving.hf
from cp_compile.serving.hf.rank_load import checkpoint_dtype, load_rank_local
from cp_compile.serving.hf.tp import shard_model
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import hf_qwen3
from examples.models.tiny_seed import tiny_seed_model

TP = 2
KINDS = {  # kind -> (builder, dtype saved)
    "qwen3": (lambda: hf_qwen3(tie=True, num_kv_heads=2), torch.bfloat16),
    "deepseek_v32": (lambda: tiny_seed_model("deepseek_v32"), torch.float32),
    "qwen3_moe": (lambda: tiny_seed_model("qwen3_moe"), torch.bfloat16),
}
PROMPTS = [[5, 9, 3, 17, 40, 2, 8], [11, 4, 60]]
SERVED = ("deepseek_v32",)  # the slow test also serves these through Engine (each Engine costs a trace)


def save(kind: str, path: str) -> str:
    build, dtype = KINDS[kind]
    model = build().to(dtype)
    model.generation_config.eos_token_id = None  # fixed-length runs
    model.save_pretrained(path, max_shard_size="40KB")  # several files + the index
    return path


def _serve(model, tp: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    cfg = cp_compile.CPConfig(tensor_parallel_size=tp, block_size=4)
    engine = cp_compile.serving.hf.Engine(model, cfg, num_blocks=16, lowering="eager", record_logits=True)
    tokens = engine.generate(PROMPTS, max_new_tokens=4)
    return tokens, [torch.stack(engine.last_logits[i]) for i in range(len(PROMPTS))]


def _rank(rank: int, world: int, paths: dict[str, str], served: tuple[str, ...] = ()) -> dict:
    state = cp_compile.init_parallel(cp_compile.CPConfig(tensor_parallel_size=world, block_size=4), device="cpu")
    tp_rank = state.layout.tp.rank
    out = {}
    for kind, path in paths.items():
        dtype = checkpoint_dtype(transformers.AutoConfig.from_pretrained(path))
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        shard_model(ref, world, tp_rank, state.tp_group)
        mine = load_rank_local(path, world, tp_rank, state.tp_group)
        a, b = ref.state_dict(), mine.state_dict()
        tensors = {k: (tuple(a[k].shape), a[k].dtype, tuple(b[k].shape), b[k].dtype,
                       (a[k].float() - b[k].float()).abs().max().item() if a[k].shape == b[k].shape else None)
                   for k in a if k in b}
        x = torch.tensor([PROMPTS[0]])
        with torch.no_grad():  # HF's own forward over the sharded modules (its all-reduces included)
            fwd = (ref(x).logits[0].float(), mine(x).logits[0].float())
        ref_out, mine_out = (_serve(ref, world), _serve(mine, world)) if kind in served else (None, None)
        out[kind] = dict(fwd=fwd, keys=(sorted(a), sorted(b)), tensors=tensors, dtype=dtype, ref=ref_out, mine=mine_out,
                         tied=mine.lm_head.weight is mine.model.embed_tokens.weight,
                         loaded=mine.cp_loaded_bytes,
                         shard_bytes=sum(t.numel() * t.element_size() for t in ref.parameters()))
    return out


@pytest.mark.parametrize("served", [pytest.param((), id="hf-forward"),
                                    pytest.param(SERVED, id="engine", marks=pytest.mark.slow)])
def test_rank_local_load_equals_load_then_shard(tmp_path, served):
    paths = {k: save(k, str(tmp_path / k)) for k in KINDS}
    for path in paths.values():
        assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    outs = run_on_ranks(_rank, TP, paths, served, timeout=600)
    for rank, out in enumerate(outs):
        for kind, r in out.items():
            assert r["keys"][0] == r["keys"][1], (rank, kind)
            for name, (sa, da, sb, db, diff) in r["tensors"].items():
                assert (sa, da) == (sb, db), (rank, kind, name, sa, da, sb, db)
                assert diff == 0.0, (rank, kind, name, diff)  # the same bytes, read two ways
            tol = 2e-2 if r["dtype"] == torch.bfloat16 else 1e-5
            torch.testing.assert_close(r["fwd"][1], r["fwd"][0], atol=tol, rtol=tol)
            if r["ref"] is not None:
                (ref_tokens, ref_logits), (tokens, logits) = r["ref"], r["mine"]
                assert tokens == ref_tokens, (rank, kind)
                for x, y in zip(logits, ref_logits):
                    torch.testing.assert_close(x, y, atol=tol, rtol=tol)
        assert out["qwen3"]["tied"] and out["qwen3"]["dtype"] == torch.bfloat16
        assert out["deepseek_v32"]["dtype"] == torch.float32
        for kind, r in out.items():  # this rank read its shard only: well under the checkpoint's bytes
            ckpt = sum(os.path.getsize(os.path.join(paths[kind], f)) for f in os.listdir(paths[kind])
                       if f.endswith(".safetensors"))
            assert r["loaded"] <= r["shard_bytes"] + 4096 < 0.8 * ckpt, (rank, kind, r["loaded"], ckpt)


def test_bad_checkpoints_refused_by_name(tmp_path):
    path = save("qwen3", str(tmp_path / "q"))
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "w8a8"}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    with pytest.raises(cp_compile.ConfigError, match="quant_method='w8a8'.*Fix: serve the bf16"):
        load_rank_local(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    with pytest.raises(cp_compile.ConfigError, match="neither model.safetensors.index.json nor model.safetensors"):
        load_rank_local(str(empty))


def _fused_checkpoint(model, path: str) -> str:
    """The model's own state dict (HF's fused `experts.gate_up_proj` / `down_proj`) as
    one safetensors file: the other expert layout the loader reads."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(path, "model.safetensors"))
    model.config.save_pretrained(path)
    return path


@pytest.mark.parametrize("kind", ["deepseek_v2_lite", "deepseek_v3", "glm5", "qwen3_moe-fused"])
def test_each_seed_kind_loads_each_rank_shard(tmp_path, kind):
    """In one process (no forward, so no collective: the TP group is a placeholder):
    every rank's shard of each seed model equals from_pretrained + shard_model, for
    per-expert and fused expert checkpoints."""
    base = kind.removesuffix("-fused")
    model = tiny_seed_model(base)
    path = str(tmp_path / kind)
    if kind.endswith("-fused"):
        _fused_checkpoint(model, path)
    else:
        model.save_pretrained(path)
    group = object()  # stored by the row-parallel modules, used only in forward
    for rank in range(TP):
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        shard_model(ref, TP, rank, group)
        mine = load_rank_local(path, TP, rank, group)
        a, b = ref.state_dict(), mine.state_dict()
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].shape == b[k].shape and a[k].dtype == b[k].dtype, (rank, k)
            torch.testing.assert_close(b[k], a[k], atol=0, rtol=0, msg=f"rank {rank} {k}")
