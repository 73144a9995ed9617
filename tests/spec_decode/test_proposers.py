"""Proposers and rollback pieces in one process: the MTP layer read from a checkpoint's
`model.layers.{num_layers}.*` tensors, `BlockAllocator.truncate`, and single-device
speculative decoding equal to plain greedy decoding for every proposer (the layer-skip
case samples at temperature 1 with top_k = 1 on the speculative side: the filtered
distributions are one-hot, so only a sampler that filters the target's logits, as
the draft's, gives the greedy tokens)."""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile.runtime.metadata_build import BlockAllocator
from examples import spec
from examples.models.deepseek_mtp import build_mtp, random_mtp_tensors
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_sfa, hf_deepseek_v3, hf_qwen3


def test_mtp_layer_reads_the_checkpoint_tensors_strictly():
    hf = hf_deepseek_v3(q_lora_rank=None)
    sd = dict(hf.state_dict())
    target = example_from_config(hf.config, sd)
    mtp_sd = random_mtp_tensors(target, seed=7)
    n = hf.config.num_hidden_layers
    assert f"model.layers.{n}.eh_proj.weight" in mtp_sd and f"model.layers.{n}.self_attn.kv_b_proj.weight" in mtp_sd
    full = {**sd, **mtp_sd}
    target2 = example_from_config(hf.config, full)  # the causal LM skips its MTP layer's tensors
    loaded, fresh = build_mtp(target2, full), build_mtp(target2, sd, seed=7)
    other = build_mtp(target2, sd, seed=8)  # no MTP tensors: random layer
    for (name, a), b, c in zip(loaded.state_dict().items(), fresh.state_dict().values(), other.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    assert any(not torch.equal(a, c) for a, c in zip(loaded.state_dict().values(), other.state_dict().values()))
    with pytest.raises(ValueError, match="not used"):
        build_mtp(target2, {**full, f"model.layers.{n}.mystery.weight": torch.zeros(1)})


def test_truncate_gives_back_the_blocks_past_the_tokens():
    alloc = BlockAllocator(8, 4)
    alloc.ensure(0, 13)  # 4 blocks
    alloc.ensure(1, 2)
    assert alloc.truncate(0, 5) == [2, 3] and alloc.blocks(0) == [0, 1] and alloc.num_free == 5
    assert alloc.truncate(0, 8) == [] and alloc.truncate(1, 0) == [4]
    assert alloc.ensure(2, 4) == [4]  # the freed block is handed out first
    with alloc.transaction(), pytest.raises(RuntimeError, match="truncate"):
        alloc.truncate(0, 1)


@pytest.mark.parametrize("kind,proposer,k", [("qwen3", "draft", 3), ("qwen3", "layer_skip", 2), ("mla", "mtp", 2),
                                             ("sfa", "mtp", 3)])
def test_single_device_speculation_equals_greedy(kind, proposer, k):
    hf = {"qwen3": lambda: hf_qwen3(num_kv_heads=2), "mla": lambda: hf_deepseek_v3(q_lora_rank=None),
          "sfa": lambda: hf_deepseek_sfa("deepseek_v32")}[kind]()
    sd, dcfg, dsd = spec.proposer_weights(proposer, hf.config, dict(hf.state_dict()))
    cfg = cp_compile.CPConfig(block_size=8)
    g = torch.Generator().manual_seed(3)
    prompts = {r: torch.randint(0, VOCAB, (n,), generator=g).tolist() for r, n in {0: 9, 1: 2, 2: 5}.items()}

    sampling = dict(temperature=1.0, top_k=1) if proposer == "layer_skip" else {}

    def run(kk: int):
        models = spec.build(cfg, hf.config, sd, proposer if kk else None, kk, 32,
                            draft_hf=None if dcfg is None else (dcfg, dsd), padding=1, max_blocks_per_req=6)
        dec = spec.decoder(models, cfg, 32, padding=1, max_blocks_per_req=6, **(sampling if kk else {}))
        return dec.generate(prompts, 9), dec

    base, _ = run(0)
    res, dec = run(k)
    assert res.tokens == base.tokens and all(len(t) == 9 for t in res.tokens.values())
    assert res.stats.steps < base.stats.steps or res.stats.accepted == 0
    assert dec.alloc.num_free == 32
