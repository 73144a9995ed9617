"""`cp_compile.LLM` over a saved checkpoint directory with its own tokenizer.

In this process (world 1): greedy tokens equal HF's `generate` on the same
directory, generation stops at EOS / stop tokens / stop strings, bad requests are
refused before anything runs. Spawned (PCP 2, two CPU gloo worker processes): the
same greedy and seeded-sampling tokens as in this process (one sampler: the driver's).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

import cp_compile
from cp_compile import LLM, RequestError, SamplingParams
from examples.models.tiny_seed import save_checkpoint, tiny_seed_model

PROMPTS = ["the a of to and", "in is it", "long make thing see him two has look"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_checkpoint(tiny_seed_model("deepseek_v2_lite"), str(tmp_path_factory.mktemp("ds") / "ckpt"))


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(model=ckpt, block_size=4, lowering="eager", max_model_len=64) as engine:
        yield engine


def _hf_greedy(path: str, prompt_ids: list[int], n: int) -> list[int]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


def test_greedy_text_and_tokens_equal_hf_generate(ckpt, llm, capfd):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10))
    assert "Processed prompts" in capfd.readouterr().err  # the progress bar
    tok = llm.get_tokenizer()
    for p, o in zip(PROMPTS, outs):
        ids = tok(p)["input_ids"]
        assert o.prompt == p and o.prompt_token_ids == ids and o.finished
        c = o.outputs[0]
        assert c.token_ids == _hf_greedy(ckpt, ids, 10)
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True) and c.finish_reason == "length"
        words = [t for t in c.token_ids if t not in tok.all_special_ids]
        assert len(c.text.split()) == len(words)  # one word per non-special token


def test_stops_at_eos_stop_token_and_stop_string(ckpt, llm, tmp_path):
    base = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    eos = base.token_ids[3]
    cut = base.token_ids.index(eos)
    # A stop token id ends generation after it, like EOS.
    o = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[eos]))[0].outputs[0]
    assert o.token_ids == base.token_ids[:cut + 1] and o.finish_reason == "stop" and o.stop_reason == eos
    # A stop string: the text ends before it.
    word = llm.get_tokenizer().decode([eos])
    o = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=10, stop=[word]))[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == word and word not in o.text.split()
    assert base.text.startswith(o.text)
    # The checkpoint's own EOS (generation_config.eos_token_id), unless ignore_eos.
    path = str(tmp_path / "eos")
    save_checkpoint(tiny_seed_model("deepseek_v2_lite"), path)
    with open(os.path.join(path, "generation_config.json")) as f:
        gen = json.load(f)
    gen["eos_token_id"] = eos
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f)
    with LLM(model=path, block_size=4, lowering="eager", max_model_len=64) as other:
        o = other.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
        assert o.token_ids == base.token_ids[:cut + 1] and o.finish_reason == "stop"
        o = other.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        assert o.token_ids == base.token_ids


@pytest.mark.parametrize("prompt,params,field", [
    ("the " * 70, SamplingParams(max_tokens=4), "prompt"),  # longer than max_model_len = 64
    ("the a", SamplingParams(max_tokens=100), "max_tokens"),
    ([5, 999], SamplingParams(max_tokens=4), "prompt"),  # id >= vocab
    ([], SamplingParams(max_tokens=4), "prompt"),
])
def test_bad_requests_refused_before_any_step(llm, prompt, params, field):
    steps = llm.driver.steps
    with pytest.raises(RequestError) as e:
        llm.generate([prompt, "the a"], params, use_tqdm=False)
    assert e.value.field == field, e.value
    assert llm.driver.steps == steps and not llm.driver.has_work()


def test_spawned_pcp_ranks_give_the_in_process_tokens(ckpt, llm):
    """Two spawned worker ranks (PCP 2: prefill token-sharded, decode over the 2-way
    sharded cache) produce the in-process tokens, greedy and seeded sampling: only the
    driver samples, and the ranks' logits agree with one device's."""
    greedy = SamplingParams(temperature=0, max_tokens=8)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, max_tokens=8, seed=5)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [greedy, sampled, sampled], use_tqdm=False)]
    with LLM(model=ckpt, prefill_context_parallel_size=2, block_size=4, lowering="aot_eager",
             max_model_len=64) as spawned:
        got = [o.outputs[0].token_ids for o in spawned.generate(PROMPTS, [greedy, sampled, sampled],
                                                                use_tqdm=False)]
        procs = list(spawned.executor.procs)
        cap = spawned.kv_capacity
    assert got == want
    assert all(p.poll() is not None for p in procs)  # torn down
    assert len(cap) == 2 and cap[0]["kv_bytes_per_rank"] * 2 == cap[0]["kv_bytes_per_rank_dcp1"]


def test_constructor_refuses_before_starting_ranks(tmp_path, ckpt):
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(TypeError, match="unsupported arguments \\['gpu_memory_utilization'\\]"):
        LLM(model=str(tmp_path), gpu_memory_utilization=0.9)
    with pytest.raises(cp_compile.ConfigError, match="decode_context_parallel_size=3"):
        LLM(model=ckpt, tensor_parallel_size=2, decode_context_parallel_size=3)
    with pytest.raises(ValueError, match="dtype='float8'"):
        LLM(model=ckpt, dtype="float8")
