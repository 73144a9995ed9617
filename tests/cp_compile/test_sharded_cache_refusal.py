"""A single-device attention op never runs over a DCP-sharded cache (issue 19).

Before: the SFA example model called directly (not through the compiled entry) with an
initialised dcp = 2 state passed `validate_step` (global metadata) and its single-device
sparse op wrote and read the sharded latent cache by global slots: logits off by 4.23,
no error. A user's own uncompiled module calling the op (it never calls
`validate_step`), or any model handed a view of the cache (the tag on the tensor
object was lost), still ran. Now `allocate_kv_cache` marks the cache's storage
(`ops/core/sharded_cache.py`) and every single-device attention op refuses it before
writing, on every rank; a copy is a plain cache; the compiled entry of the same model
on the same cache still runs.

The same two-rank world also runs the README's plain `torch.compile(model, backend=...)`
path at dcp 2 (no decorator, no compile_model) with bad `seq_lens`
(test_plain_backend_validates.py covers one device): one spawn for both.
"""

from __future__ import annotations

import torch

import cp_compile
from cp_compile.base.errors import ConfigError
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_sfa, hf_qwen3
from examples.serving import layer_caches
from tests.cp_compile.test_plain_backend_validates import assert_refused, run_bad_step

RULE = "a single-device attention op never runs over a DCP / PCP-sharded cache"


class OwnModel(torch.nn.Module):
    """A user's own model: calls the op, never validate_step."""

    def forward(self, q_nope, q_pe, kv_c, k_pe, kv_cache, meta):
        return torch.ops.cp.mla_attention(q_nope, q_pe, kv_c, k_pe, kv_cache, meta.slot_mapping, meta.block_table,
                                          meta.seq_lens, meta.query_start_loc, 0.1)


def _refusal(call) -> str:
    try:
        call()
    except ConfigError as e:
        return str(e)
    return "ran"


def _world(rank: int, world: int, hf_config, sd, qwen_config, qwen_sd) -> dict:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=world, block_size=4)
    state = cp_compile.init_parallel(cfg, device="cpu")
    model = example_from_config(hf_config, sd, world, state.layout.tp.rank, state.tp_group)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), 8, attention=model.attention_spec())
    layers = layer_caches(cache)
    meta = cp_compile.build_attention_metadata([(0, 6)], cp_compile.BlockAllocator(8, cfg.virtual_block_size))
    ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(0))
    out = {}
    with torch.no_grad():
        out["eager"] = _refusal(lambda: model(ids, meta.positions, layers, meta))
        # A user's own module over the sharded latent cache, the cache itself and views of it.
        latent = cache.layers[0][0]  # [NB, BS, L+R]
        L = latent.shape[-1] - 4
        g = torch.Generator().manual_seed(1)
        q_nope, q_pe = torch.randn(6, 2, L, generator=g), torch.randn(6, 2, 4, generator=g)
        kv_c, k_pe = torch.randn(6, L, generator=g), torch.randn(6, 4, generator=g)
        own = OwnModel()
        # Metadata of the cache's own 4-token pages, as a user who ignores DCP builds it:
        # every check passes and, unrefused, the op attends this rank's half of the tokens.
        plain = cp_compile.build_attention_metadata([(0, 6)], cp_compile.BlockAllocator(8, 4))
        for name, c in (("own", latent), ("own_slice", latent[:]), ("own_view", latent.view(latent.shape)),
                        ("own_narrow", latent.narrow(0, 0, latent.shape[0]))):
            out[name] = _refusal(lambda c=c: own(q_nope, q_pe, kv_c, k_pe, c, plain))
        out["untouched"] = all(int(t.count_nonzero()) == 0 for layer in layers for t in layer)
        # A copy is new memory, a plain (dcp = 1) cache: it runs.
        out["clone_runs"] = _refusal(lambda: own(q_nope, q_pe, kv_c, k_pe, latent.clone(), plain)) == "ran"
        logits = cp_compile.compile_model(model, lowering="eager")(ids, meta.positions, layers, meta)
    out["compiled_finite"] = bool(torch.isfinite(logits).all())
    # The README's plain torch.compile at dcp 2: an explicit cp_ascend backend (the string
    # backend cannot read the model's AttentionSpec, which dcp 2 requires).
    qwen = example_from_config(qwen_config, qwen_sd, world, state.layout.tp.rank, state.tp_group)
    qcache = cp_compile.allocate_kv_cache(cfg, qwen.kv_cache_spec(), 6, attention=qwen.attention_spec())
    be = cp_compile.backend(lowering="eager", attention=qwen.attention_spec())
    out["plain"] = run_bad_step(torch.compile(qwen, backend=be, fullgraph=True), qcache.layers,
                                cfg.virtual_block_size)
    out["plain"]["graphs"] = len(be.pass_managers)
    cp_compile.destroy_parallel()
    return out


def test_single_device_ops_over_dcp_sharded_cache_are_refused_and_plain_backend_validates():
    hf = hf_deepseek_sfa("deepseek_v32")
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    qwen = hf_qwen3(num_kv_heads=1, num_heads=4, num_layers=1)
    qsd = {k: v.detach().clone() for k, v in qwen.state_dict().items()}
    outs = run_on_ranks(_world, 2, hf.config, sd, qwen.config, qsd, timeout=300)
    for out in outs:
        assert RULE in out["eager"], out
        assert "1/2 shard" in out["eager"] and out["untouched"], out
        for name in ("own", "own_slice", "own_view", "own_narrow"):
            assert RULE in out[name] and "the cache of cp::mla_attention is this rank's 1/2 shard" in out[name], \
                (name, out[name])
        assert "Fix: compile the model with cp_compile.compile_model" in out["own"], out["own"]
        assert out["clone_runs"], out
        assert out["compiled_finite"], out
        assert_refused(out["plain"])
        assert out["plain"]["graphs"] >= 1  # the DCP passes ran (compiled), then the bad step was refused
    assert outs[0]["plain"]["error"] == outs[1]["plain"]["error"]  # same verdict on every rank
    torch.testing.assert_close(outs[0]["plain"]["good"], outs[1]["plain"]["good"], atol=1e-5, rtol=1e-5)
