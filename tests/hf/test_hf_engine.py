"""cp_compile.serving.hf on real gloo ranks: unmodified HF models served with TP + DCP must
generate exactly what HF's own single-device greedy `generate` does.

Each world builds the HF model from its config on every rank, shards it with the
head-sharding TP plan, and serves three prompts with continuous batching (one
request joins at step 3, one leaves early), 16 new tokens for the longest, through
one compiled graph (recompiles forbidden after two warm-up steps). Logits of every
generated token must match HF's within fp32 1e-4 and the tokens must be equal.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import time

import pytest
import torch
import transformers

import cp_compile
import cp_compile.serving.hf
from cp_compile.testing.multirank import run_on_ranks
from examples.hf_generate import hf_reference, serve, tiny_hf
from examples.models.tiny import VOCAB

BLOCK = 4
NUM_BLOCKS = 16
MAX_NEW = [16, 10, 16]  # request 1 leaves early
ARRIVALS = [0, 0, 3]  # request 2 joins at step 3 (a prefill beside decodes)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 5)]


CASES = [
    # model, KV heads, tp, dcp, lowering
    pytest.param("qwen3", 1, 2, 2, "inductor", id="qwen3-kv1-tp2-dcp2-inductor"),
    # 4 ranks, ~70 s here; KV-head replication at tp > kv heads is default-tested per op (tests/ops/test_dcp_kv_heads.py)
    pytest.param("llama", 2, 4, 2, "aot_eager", id="llama-kv2-tp4-dcp2-aot_eager", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 4, 2, 2, "aot_eager", id="deepseek_v3-mla-tp2-dcp2-aot_eager"),
    pytest.param("mistral", 1, 2, 2, "aot_eager", id="mistral-kv1-tp2-dcp2-aot_eager", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", 4, 2, 2, "inductor", id="deepseek_v3-mla-tp2-dcp2-inductor", marks=pytest.mark.slow),
    pytest.param("qwen3", 2, 4, 2, "aot_eager", id="qwen3-kv2-tp4-dcp2-aot_eager", marks=pytest.mark.slow),
]


def _expected_kv_bytes_dcp1(hf_config, tp: int, dcp: int) -> int:
    """What one rank would hold for the same token capacity at dcp = 1 (computed from
    the HF config, independently of the engine)."""
    tokens = NUM_BLOCKS * BLOCK * dcp
    layers = hf_config.num_hidden_layers
    if hf_config.model_type == "deepseek_v3":
        return tokens * layers * (hf_config.kv_lora_rank + hf_config.qk_rope_head_dim) * 4
    kv_per_rank = max(hf_config.num_key_value_heads // tp, 1)
    return tokens * layers * 2 * kv_per_rank * hf_config.head_dim * 4


@pytest.mark.parametrize("kind,kv_heads,tp,dcp,lowering", CASES)
def test_hf_model_matches_hf_generate(kind, kv_heads, tp, dcp, lowering):
    hf = tiny_hf(kind, num_kv_heads=kv_heads)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    prompts = _prompts()
    t0 = time.time()
    outs = run_on_ranks(serve, tp, copy.deepcopy(hf.config), sd, prompts, MAX_NEW, dcp, BLOCK, NUM_BLOCKS,
                        lowering, ARRIVALS, timeout=900)
    wall = time.time() - t0
    ref_tokens, ref_logits = hf_reference(hf, prompts, max(MAX_NEW))
    worst = 0.0
    layers = hf.config.num_hidden_layers
    for rank, out in enumerate(outs):
        assert out["graphs"] == 1, f"rank {rank}: {out['graphs']} graphs (recompiled)"
        assert out["steps"] >= 16
        assert out["history"][0] == ("dcp_attention", layers), out["history"]
        for i in range(len(prompts)):
            n = MAX_NEW[i]
            assert out["tokens"][i] == ref_tokens[i][:n], f"rank {rank} prompt {i}"
            torch.testing.assert_close(out["logits"][i], ref_logits[i][:n], atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"rank {rank} prompt {i}: {m}")
            worst = max(worst, (out["logits"][i] - ref_logits[i][:n]).abs().max().item())
        cap = out["capacity"]
        assert cap["tokens_per_rank"] == NUM_BLOCKS * BLOCK and cap["tokens_per_group"] == NUM_BLOCKS * BLOCK * dcp
        assert cap["kv_bytes_per_rank_dcp1"] == _expected_kv_bytes_dcp1(hf.config, tp, dcp)
        assert cap["kv_bytes_per_rank"] * dcp == cap["kv_bytes_per_rank_dcp1"]
    if kind != "deepseek_v3":
        # DCP groups (consecutive ranks) hold the same KV heads; TP replicates each over tp // kv ranks.
        heads = [o["plan"]["kv_heads"] for o in outs]
        for r in range(tp):
            assert heads[r] == heads[r - r % dcp]
    cap = outs[0]["capacity"]
    print(f"\nPARITY {kind} kv={kv_heads} tp={tp} dcp={dcp} {lowering}: max|dlogit| {worst:.2e} tokens equal, "
          f"graphs 1, steps {outs[0]['steps']}, KV/rank {cap['kv_bytes_per_rank']} B vs dcp=1 "
          f"{cap['kv_bytes_per_rank_dcp1']} B, wall {wall:.0f}s")


@pytest.mark.parametrize("config,feature", [
    (lambda: transformers.MistralConfig(sliding_window=4096), "sliding window"),
    (lambda: transformers.Qwen3Config(use_sliding_window=True, sliding_window=8, max_window_layers=0,
                                      num_hidden_layers=2), "sliding window"),
    (lambda: transformers.Gemma2Config(), "soft-capping"),
    (lambda: transformers.GptOssConfig(), "sinks"),
    (lambda: transformers.Qwen3NextConfig(), "linear / hybrid attention"),
    (lambda: transformers.BartConfig(), "encoder-decoder"),
    (lambda: transformers.GPT2Config(), "architecture"),
])
def test_unsupported_features_refused_by_name(config, feature):
    cfg = config()
    with pytest.raises(cp_compile.serving.hf.UnsupportedModelError, match=feature) as e:
        cp_compile.serving.hf.check_supported(cfg)
    assert isinstance(e.value, cp_compile.ConfigError) and "Fix:" in str(e.value)


def test_engine_refuses_at_load():
    """The check runs in Engine, before any cache or compile."""
    hf = tiny_hf("mistral")
    hf.config.sliding_window = 8
    with pytest.raises(cp_compile.serving.hf.UnsupportedModelError, match="sliding window"):
        cp_compile.serving.hf.Engine(hf, cp_compile.CPConfig(block_size=BLOCK), num_blocks=4)


def test_plain_import_does_not_import_transformers():
    code = "import sys, cp_compile; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dcp_beyond_kv_replication_refused():
    """tp = 4 over 2 KV heads replicates each head on 2 ranks: dcp = 4 would put
    different heads in one DCP group. Refused by the config rule, with the fix."""
    hf = tiny_hf("qwen3", num_kv_heads=2)
    cfg = cp_compile.CPConfig(tensor_parallel_size=4, decode_context_parallel_size=4, block_size=BLOCK)
    with pytest.raises(cp_compile.ConfigError, match="num_kv_heads"):
        cp_compile.serving.hf.Engine(hf, cfg, num_blocks=4)


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_single_request_joins_and_leaves_without_recompiles(kind, capfd):
    """One device, eager lowering: batches of 1 -> 2 -> 1 requests (no size-1
    specialisation: `decorator.no_size_specialisation`) stay one graph and equal HF generate. Qwen2
    (q/k/v biases) is checked here only."""
    hf = tiny_hf(kind, num_kv_heads=2)
    prompts = _prompts()[:2]
    max_new = [16, 4]
    arrivals = [0, 5]  # alone for 5 steps, then a second joins, leaves after 4 tokens
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    out = serve(0, 1, hf.config, sd, prompts, max_new, 1, BLOCK, NUM_BLOCKS, "eager", arrivals, progress=True)
    assert "cp_compile.serving.hf generate" in capfd.readouterr().err  # the progress bar (tqdm, stderr)
    ref_tokens, ref_logits = hf_reference(hf, prompts, 16)
    assert out["graphs"] == 1
    for i in range(2):
        assert out["tokens"][i] == ref_tokens[i][:max_new[i]]
        torch.testing.assert_close(out["logits"][i], ref_logits[i][:max_new[i]], atol=1e-4, rtol=1e-4)


def _hf_sharded_world(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    model = tiny_hf("qwen3")
    # What HF's loader sets after sharding with tp_plan / DistributedConfig
    # (transformers/distributed/mixin.py: model._device_mesh = ...); loading that way
    # needs `accelerate` and a checkpoint on disk, so the attribute is set directly.
    model._device_mesh = init_device_mesh("cpu", (world,))
    try:
        cp_compile.serving.hf.Engine(model, cp_compile.CPConfig(block_size=BLOCK), num_blocks=4)
    except cp_compile.ConfigError as e:
        return str(e)
    return "accepted"


def test_model_sharded_by_hf_refused_naming_both_meshes():
    (msg,) = run_on_ranks(_hf_sharded_world, 1)
    assert "HF device mesh ranks [0], init_parallel TP group ranks [0]" in msg, msg


def test_request_beyond_capacity_refused_before_any_step():
    hf = tiny_hf("llama")
    engine = cp_compile.serving.hf.Engine(hf, cp_compile.CPConfig(block_size=BLOCK), num_blocks=3, lowering="eager")
    # 3 blocks of 4 tokens: 12 tokens per request at most.
    assert engine.max_model_len == 12
    with pytest.raises(ValueError, match="max_model_len=12. Fix"):
        engine.generate([[1, 2, 3, 4, 5]], max_new_tokens=8)
    assert engine.steps == 0 and engine.num_graphs == 0


def test_front_end_inputs_refused_before_any_step():
    """Issue 19: max_new_tokens=0 returned one token (HF raises); a token id >= vocab size
    failed as `IndexError: index out of range in self`, naming neither prompt nor token."""
    hf = tiny_hf("llama")
    engine = cp_compile.serving.hf.Engine(hf, cp_compile.CPConfig(block_size=BLOCK), num_blocks=3, lowering="eager")
    with pytest.raises(ValueError, match=r"prompt 0: max_new_tokens=0 must be an integer >= 1"):
        engine.generate([[1, 2]], max_new_tokens=0)
    vocab = hf.config.vocab_size
    with pytest.raises(ValueError, match=rf"prompt 1: token {vocab} at position 2 is outside the vocabulary "
                                         rf"\[0, {vocab}\)"):
        engine.generate([[1, 2], [3, 4, vocab]], max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt 0: token -1 at position 0"):
        engine.generate([[-1]], max_new_tokens=1)
    assert engine.steps == 0 and engine.num_graphs == 0


@pytest.mark.parametrize("prompts,kw,match", [
    ([[1, 3.7]], {}, r"prompt 0: token 3.7 at position 1 is not an integer token id"),  # was served as 3
    ([[2], [1, True]], {}, r"prompt 1: token True at position 1 is not an integer token id"),
    ([[1, "7"]], {}, r"prompt 0: token '7' at position 1 is not an integer token id"),
    ([1, 2], {}, r"prompt 0: 1 is not a list of token ids"),  # one flat prompt for a list of prompts
    ([[1, 2]], dict(max_new_tokens=2.0), r"max_new_tokens=2.0 must be an integer >= 1"),  # 'float' not iterable
    ([[1, 2]], dict(max_new_tokens=True), r"max_new_tokens=True must be an integer >= 1"),
    ([[1], [2]], dict(max_new_tokens=[2]), r"max_new_tokens: 1 values for 2 prompts"),  # was IndexError
    ([[1], [2]], dict(arrivals=[0]), r"arrivals: 1 values for 2 prompts"),  # was IndexError
    ([[1], [2]], dict(arrivals=[0, 1.5]), r"arrivals\[1\]=1.5 must be an integer step >= 0"),
    ([[1], [2]], dict(arrivals=[0, -1]), r"arrivals\[1\]=-1 must be an integer step >= 0"),
    ([[1], [2]], dict(arrivals=3), r"arrivals=3 must be a list"),
])
def test_generate_arguments_typed_at_the_door(prompts, kw, match):
    """Issue 35: token ids are ints (bool, float and str refused naming the prompt, the
    position and the value); max_new_tokens and arrivals are checked for type, length
    and values. A refused call takes nothing: no step, no compile, no KV block."""
    hf = tiny_hf("llama")
    engine = cp_compile.serving.hf.Engine(hf, cp_compile.CPConfig(block_size=BLOCK), num_blocks=3, lowering="eager")
    with pytest.raises(ValueError, match=match) as e:
        engine.generate(prompts, **kw)
    assert "Fix:" in str(e.value), e.value
    assert engine.steps == 0 and engine.num_graphs == 0 and engine.alloc.num_free == engine.num_blocks


def _full_length_request_runs(engine) -> None:
    """A request of exactly max_model_len tokens needs every block of the cache."""
    out = engine.generate([[1] * (engine.max_model_len - 2)], max_new_tokens=2)
    assert len(out[0]) == 2
    assert engine.alloc.num_free == engine.num_blocks


def test_refused_token_leaks_no_blocks():
    """A prompt holding a non-integer token ("7": `int()` takes it, the input tensor
    did not) raised TypeError from inside the first step, after that step had taken
    KV blocks: a later request of max_model_len got CapacityError."""
    hf = tiny_hf("llama")
    engine = cp_compile.serving.hf.Engine(hf, cp_compile.CPConfig(block_size=BLOCK), num_blocks=3, lowering="eager")
    with pytest.raises((TypeError, ValueError)):  # TypeError before; now ValueError naming the token
        engine.generate([[1, "7", 5], [2, 3]], max_new_tokens=2)
    assert engine.alloc.num_free == engine.num_blocks
    _full_length_request_runs(engine)


def test_generate_that_fails_mid_run_returns_every_block():
    """A step that raises (here the model, on the third step: one request running, one
    waiting for blocks) ends the call with every KV block back in the engine's
    allocator and nothing left of the call's requests; the engine serves a full-length
    request after it."""
    hf = tiny_hf("llama")
    engine = cp_compile.serving.hf.Engine(hf, cp_compile.CPConfig(block_size=BLOCK), num_blocks=3, lowering="eager")
    model, calls = engine.compiled, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("model failed at step 3")
        return model(*args, **kwargs)

    engine.compiled = failing
    # Two blocks each: the second request waits for the first's blocks.
    with pytest.raises(RuntimeError, match="step 3"):
        engine.generate([[1, 2, 3], [4, 5, 6]], max_new_tokens=4)
    assert len(calls) == 3
    assert engine.alloc.num_free == engine.num_blocks
    assert all(engine.alloc.blocks(rid) == [] for rid in (0, 1))
    engine.compiled = model
    _full_length_request_runs(engine)
