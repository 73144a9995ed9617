"""Peak host memory of rank-local loading, measured per rank from /proc (VmHWM).

A random bf16 checkpoint is written shard by shard (examples/random_checkpoint.py,
never the whole model in memory). On gloo ranks:

* default (tp 2, ~300 MB): each rank's peak increase while loading rank-locally is at
  most its shard + 64 MB (one tensor's slices in flight), while `from_pretrained` of
  the same checkpoint (today's path, before it shards) raises the peak by the whole
  model, more than that bound;
* slow (tp 4, >= 8 GB, the issue's target): each rank loads rank-locally, builds the
  Engine and generates; its absolute peak RSS (imports included) stays within
  shard + KV + 1.5 GB, and the whole-model figure (checkpoint + the same baseline)
  is above that bound. The figures go to docs/hf.md.
"""

from __future__ import annotations

import gc
import os
import shutil

import pytest
import torch
import transformers

import cp_compile
from cp_compile.testing.memory import peak_bytes, reset_peak, rss_bytes
from cp_compile.testing.multirank import run_on_ranks
from examples.random_checkpoint import write_random_checkpoint

MB = 1 << 20
GB = 1 << 30
LOADER_OVERHEAD = 64 * MB  # default test: the loader's own transient (one tensor's slices + their cat)
SERVING_OVERHEAD = int(1.5 * GB)  # slow test: imports, compile, activations (the figure)


def dense_config(layers: int, hidden: int, inter: int, vocab: int, heads: int, kv_heads: int) -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        max_position_embeddings=4096, dtype="bfloat16")


def expected_shard_bytes(cfg: transformers.Qwen3Config, tp: int) -> int:
    """This rank's bytes from the config alone: attention and MLP split tp ways, K/V by
    KV heads (tp <= kv heads here), embeddings / lm_head / norms replicated."""
    h, d, i = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    attn = 2 * cfg.num_attention_heads * d * h + 2 * cfg.num_key_value_heads * d * h  # q, o, k, v
    per_layer = (attn + 3 * h * i) // tp + 2 * h + 2 * d  # + input / post norms, q_norm / k_norm
    return 2 * (cfg.num_hidden_layers * per_layer + 2 * cfg.vocab_size * h + h)


def _load_peaks(rank: int, world: int, path: str) -> dict:
    from cp_compile.serving.hf.rank_load import load_rank_local
    from cp_compile.serving.hf.tp import shard_model

    state = cp_compile.init_parallel(cp_compile.CPConfig(tensor_parallel_size=world), device="cpu")
    gc.collect()
    reset_peak()
    base = rss_bytes()
    model = load_rank_local(path, world, state.layout.tp.rank, state.tp_group)
    local = dict(increase=peak_bytes() - base, shard=model.cp_loaded_bytes,
                 params=sum(p.numel() * p.element_size() for p in model.parameters()))
    del model
    today = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):  # fp32: EngineArgs' old default
        gc.collect()
        reset_peak()
        base = rss_bytes()
        whole = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        loaded = peak_bytes() - base
        shard_model(whole, world, state.layout.tp.rank, state.tp_group)
        today[name] = (loaded, peak_bytes() - base)
        del whole
    return dict(local=local, today=today)


def test_rank_local_peak_is_the_shard_not_the_model(tmp_path):
    cfg = dense_config(layers=8, hidden=1024, inter=4096, vocab=8192, heads=8, kv_heads=2)
    path = str(tmp_path / "ckpt")
    ckpt = write_random_checkpoint(cfg, path, max_shard_bytes=64 * MB)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 1
    outs = run_on_ranks(_load_peaks, 2, path, timeout=600)
    shard = expected_shard_bytes(cfg, 2)
    for rank, out in enumerate(outs):
        local = out["local"]
        print(f"rank {rank}: checkpoint {ckpt / MB:.0f} MB, shard {local['shard'] / MB:.0f} MB, peak increase "
              f"rank-local {local['increase'] / MB:.0f} MB, today {out['today']}")
        assert local["shard"] == local["params"] == shard, (rank, local, shard)
        bound = shard + LOADER_OVERHEAD
        assert local["increase"] <= bound, (rank, local["increase"], bound)
        # Today's path (from_pretrained, then shard_model) at EngineArgs' old default dtype
        # (fp32) holds the whole model, above the bound. At the checkpoint's own dtype
        # transformers 5 maps the files lazily and shard_model copies the cut: its figure
        # (printed, docs/hf.md) depends on what the allocator kept from the phase before,
        # so it is not asserted.
        assert out["today"]["fp32"][1] >= 1.8 * ckpt > bound, (rank, out["today"], ckpt, bound)


def _serve_peak(rank: int, world: int, path: str, num_blocks: int) -> dict:
    from cp_compile.serving.hf.rank_load import load_rank_local

    cfg = cp_compile.CPConfig(tensor_parallel_size=world, block_size=16)
    state = cp_compile.init_parallel(cfg, device="cpu")
    base = rss_bytes()
    model = load_rank_local(path, world, state.layout.tp.rank, state.tp_group)
    loaded = peak_bytes()
    engine = cp_compile.serving.hf.Engine(model, cfg, num_blocks=num_blocks, lowering="eager", progress=False)
    tokens = engine.generate([[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]], max_new_tokens=4)
    cap = engine.capacity()
    return dict(base=base, after_load=loaded, peak=peak_bytes(), shard=model.cp_loaded_bytes,
                kv=cap["kv_bytes_per_rank"] + cap["index_bytes_per_rank"], tokens=tokens)


@pytest.mark.slow
def test_8gb_checkpoint_serves_at_tp4_within_shard_plus_kv(tmp_path):
    import cp_compile.serving.hf  # noqa: F401

    # 8.4 GiB of bf16: 22 layers of a 4096-wide dense model (GQA 32 / 8 heads), 32k vocab.
    cfg = dense_config(layers=22, hidden=4096, inter=12288, vocab=32000, heads=32, kv_heads=8)
    if shutil.disk_usage(tmp_path).free < 12 * GB:
        pytest.skip("needs 12 GB free on the temp disk for the 8 GB checkpoint")
    path = str(tmp_path / "big")
    ckpt = write_random_checkpoint(cfg, path, max_shard_bytes=2 * GB)
    assert ckpt >= 8 * GB
    outs = run_on_ranks(_serve_peak, 4, path, 64, timeout=1800)
    for rank, out in enumerate(outs):
        bound = out["shard"] + out["kv"] + SERVING_OVERHEAD
        whole = ckpt + out["base"]
        print(f"rank {rank}: checkpoint {ckpt / GB:.2f} GB, shard {out['shard'] / GB:.2f} GB, KV "
              f"{out['kv'] / MB:.0f} MB, baseline {out['base'] / MB:.0f} MB, peak after load "
              f"{out['after_load'] / GB:.2f} GB, peak serving {out['peak'] / GB:.2f} GB, bound {bound / GB:.2f} GB, "
              f"whole-model load >= {whole / GB:.2f} GB")
        assert out["peak"] <= bound, (rank, out["peak"], bound)
        assert whole > bound
        assert out["tokens"] == outs[0]["tokens"]
