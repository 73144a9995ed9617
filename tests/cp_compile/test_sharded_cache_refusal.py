"""A single-device attention op never runs over a DCP-sharded cache (issue 19).

Before: the SFA example model called directly (not through the compiled entry) with an
initialised dcp = 2 state passed `validate_step` (global metadata) and its single-device
sparse op wrote and read the sharded latent cache by global slots: logits off by 4.23,
no error. Now the cache knows its layout (`allocate_kv_cache` tags a sharded cache)
and the eager forward refuses before any write, on every rank; the compiled entry of
the same model on the same cache still runs.
"""

from __future__ import annotations

import torch

import cp_compile
from cp_compile.errors import ConfigError
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_sfa
from examples.serving import layer_caches


def _world(rank: int, world: int, hf_config, sd) -> dict:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=world, block_size=4)
    state = cp_compile.init_parallel(cfg, device="cpu")
    model = example_from_config(hf_config, sd, world, state.tp_rank, state.tp_group)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), 8, attention=model.attention_spec())
    layers = layer_caches(cache)
    meta = cp_compile.build_attention_metadata([(0, 6)], cp_compile.BlockAllocator(8, cfg.virtual_block_size))
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(0))
    out = {}
    try:
        with torch.no_grad():
            model(ids, meta.positions, layers, meta)
        out["eager"] = "ran"
    except ConfigError as e:
        out["eager"] = str(e)
    out["untouched"] = all(int(t.count_nonzero()) == 0 for layer in layers for t in layer)
    with torch.no_grad():
        logits = cp_compile.compile_model(model, lowering="eager")(ids, meta.positions, layers, meta)
    out["compiled_finite"] = bool(torch.isfinite(logits).all())
    cp_compile.destroy_parallel()
    return out


def test_uncompiled_model_over_dcp_sharded_cache_is_refused():
    hf = hf_deepseek_sfa("deepseek_v32")
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    for out in run_on_ranks(_world, 2, hf.config, sd, timeout=300):
        assert "a single-device attention op never runs over a DCP / PCP-sharded cache" in out["eager"], out
        assert "1/2 shard" in out["eager"] and out["untouched"], out
        assert out["compiled_finite"], out
