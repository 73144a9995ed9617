"""`cp_compile.LLM` over a saved checkpoint directory with its own tokenizer.

In this process (world 1): greedy tokens equal HF's `generate` on the same
directory, generation stops at EOS / stop tokens / stop strings, bad requests are
refused before anything runs; logprobs equal log_softmax of HF's logits; `n` seeded
samples are reproducible and distinct. Under torchrun (PCP 2, two CPU gloo ranks, the
default case) and spawned (PCP 2, two worker processes, `slow`): the same greedy and
seeded-sampling tokens as in this process (one sampler).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
    with LLM(model=path, block_size=4, lowering="eager", max_model_len=64) as other:  # nothing compiled yet
        limits = other.driver.limits
    assert limits.eos_token_ids == (eos,)  # read from the directory's generation_config.json
    # Those limits on the module's engine (same weights; saves a second compile): EOS
    # ends generation after it, unless ignore_eos.
    own = llm.driver.limits
    llm.driver.limits = limits
    try:
        o = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0].outputs[0]
        assert o.token_ids == base.token_ids[:cut + 1] and o.finish_reason == "stop"
        o = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
        assert o.token_ids == base.token_ids
    finally:
        llm.driver.limits = own


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


@pytest.mark.parametrize("prompt,params,match,field", [
    ([5, True, 9], SamplingParams(max_tokens=2), r"prompt 0: token True at position 1 is not an integer", "prompt"),
    ([5, 3.7, 9], SamplingParams(max_tokens=2), r"prompt 0: token 3.7 at position 1 is not an integer", "prompt"),
    ([5, "7", 9], SamplingParams(max_tokens=2), r"prompt 0: token '7' at position 1 is not an integer", "prompt"),
    ([5, 9], {"temperature": 0}, r"sampling_params\[0\]=\{'temperature': 0\} is not a SamplingParams",
     "sampling_params"),
])
def test_token_ids_and_params_typed_at_the_door(llm, prompt, params, match, field):
    """Issue 35: a bool token id was served (True as token 1); a float or str one was
    refused naming neither its position nor the fix; a dict for sampling_params failed
    with AttributeError. Refused before anything runs, naming prompt, position, value."""
    steps = llm.driver.steps
    with pytest.raises(RequestError, match=match) as e:
        llm.generate([prompt, "the a"], params, use_tqdm=False)
    assert e.value.field == field and "Fix:" in str(e.value), e.value
    assert llm.driver.steps == steps and not llm.driver.has_work()


GREEDY = SamplingParams(temperature=0, max_tokens=8)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, top_k=20, max_tokens=8, seed=5)  # = torchrun_llm_script's


@pytest.fixture(scope="module")
def in_process_tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [GREEDY, SAMPLED, SAMPLED], use_tqdm=False)]


@pytest.mark.slow  # the torchrun test below covers the same engine at PCP 2 on 2 CPU ranks
def test_spawned_pcp_ranks_give_the_in_process_tokens(ckpt, in_process_tokens):
    """Two spawned worker ranks (PCP 2: prefill token-sharded, decode over the 2-way
    sharded cache) produce the in-process tokens, greedy and seeded sampling: only the
    driver samples, and the ranks' logits agree with one device's."""
    with LLM(model=ckpt, prefill_context_parallel_size=2, block_size=4, lowering="aot_eager",
             max_model_len=64) as spawned:
        got = [o.outputs[0].token_ids for o in spawned.generate(PROMPTS, [GREEDY, SAMPLED, SAMPLED],
                                                                use_tqdm=False)]
        procs = list(spawned.executor.procs)
        cap = spawned.kv_capacity
    assert got == in_process_tokens
    assert all(p.poll() is not None for p in procs)  # torn down
    assert len(cap) == 2 and cap[0]["kv_bytes_per_rank"] * 2 == cap[0]["kv_bytes_per_rank_dcp1"]


def test_llm_under_torchrun_gives_the_in_process_tokens(ckpt, in_process_tokens):
    """`LLM` launched by torchrun on 2 CPU gloo ranks (PCP 2, no spawned workers: each
    process is a rank, rank 0's sampled tokens broadcast): every rank's tokens equal
    the in-process run's (which the slow spawned test equals too), greedy and seeded."""
    script = Path(__file__).with_name("torchrun_llm_script.py")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(script), ckpt, json.dumps(PROMPTS)], capture_output=True, text=True, timeout=900,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # Both ranks print to one pipe: a line may hold the two records back to back, so decode every record
    # that follows a "TOKENS " marker wherever it sits.
    decoder = json.JSONDecoder()
    lines = [decoder.raw_decode(part)[0] for part in proc.stdout.split("TOKENS ")[1:]]
    assert sorted(d["rank"] for d in lines) == [0, 1], proc.stdout
    for d in lines:
        assert d["tokens"] == in_process_tokens, (d, in_process_tokens)
        cap = d["capacity"][0]
        assert cap["kv_bytes_per_rank"] * 2 == cap["kv_bytes_per_rank_dcp1"]  # this rank holds half the KV


def test_llm_under_torchrun_refuses_a_wrong_world(ckpt, monkeypatch):
    """WORLD_SIZE must equal tensor_parallel_size * prefill_context_parallel_size,
    refused before any process group or engine is built."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(cp_compile.ConfigError, match="WORLD_SIZE=4"):
        LLM(model=ckpt, prefill_context_parallel_size=2)


def test_constructor_refuses_before_starting_ranks(tmp_path, ckpt):
    with pytest.raises(ValueError, match="not a local directory"):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(TypeError, match="unsupported arguments \\['gpu_memory_utilization'\\]"):
        LLM(model=str(tmp_path), gpu_memory_utilization=0.9)
    with pytest.raises(cp_compile.ConfigError, match="decode_context_parallel_size=3"):
        LLM(model=ckpt, tensor_parallel_size=2, decode_context_parallel_size=3)
    with pytest.raises(ValueError, match="dtype='float8'"):
        LLM(model=ckpt, dtype="float8")
    # Longer than the checkpoint's positions: refused, not served silently shorter.
    positions = transformers.AutoConfig.from_pretrained(ckpt).max_position_embeddings
    with pytest.raises(cp_compile.ConfigError, match=f"max_model_len={positions + 1}.*max_position_embeddings"):
        LLM(model=ckpt, max_model_len=positions + 1)


def _hf_log_softmax(path: str, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """One device, one forward over prompt + output: log_softmax of the logits that
    predicted each output token, [len(output), vocab]."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0]
    n = len(prompt_ids)
    return torch.log_softmax(logits[n - 1:n - 1 + len(output_ids)].float(), -1)


def test_logprobs_equal_log_softmax_of_the_reference_logits(ckpt, llm):
    """vLLM's raw logprobs, greedy (top 5) and sampled (top 3) in one batch: per token
    the sampled token's log-probability, its rank, and the top `logprobs`, from the
    model's logits before temperature / top-k (a sampled token can rank below 1);
    cumulative_logprob is their sum."""
    plist = [SamplingParams(temperature=0, max_tokens=6, logprobs=5),
             SamplingParams(temperature=0.8, top_k=20, max_tokens=6, logprobs=3, seed=3)]
    outs = llm.generate(PROMPTS[:2], plist, use_tqdm=False)
    tok = llm.get_tokenizer()
    worst = 0.0
    for params, o in zip(plist, outs):
        c = o.outputs[0]
        ref = _hf_log_softmax(ckpt, o.prompt_token_ids, c.token_ids)
        assert len(c.logprobs) == len(c.token_ids) == params.max_tokens
        for pos, (t, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            assert list(entry)[0] == t and entry[t].decoded_token == tok.decode([t])
            assert entry[t].rank == int((ref[pos] > ref[pos, t]).sum()) + 1
            assert set(ref[pos].topk(params.logprobs).indices.tolist()) <= set(entry)
            for i, lp in entry.items():
                worst = max(worst, abs(lp.logprob - ref[pos, i].item()))
            if params.temperature:  # raw, not the tempered distribution the sample came from
                tempered = torch.log_softmax(ref[pos] / params.temperature, -1)  # log_softmax(logits / t)
                assert abs(entry[t].logprob - tempered[t].item()) > 1e-3
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
    assert worst < 1e-4, worst
    print(f"\nLOGPROBS greedy top 5 + sampled (t 0.8, top-k 20) top 3, 6 tokens each: "
          f"max |logprob - HF log_softmax| = {worst:.1e}")


def test_n_samples_are_reproducible_with_distinct_seeds(llm):
    """n = 4 seeded samples of one prompt: the samples differ, and sample i is the
    n = 1 request seeded seed + i (vLLM's rule) run in another batch (reproducible);
    greedy n = 2 repeats itself."""
    sp = SamplingParams(temperature=1.0, max_tokens=8, seed=11, n=4, logprobs=0)
    out = llm.generate(PROMPTS[:2], [sp, SamplingParams(temperature=0, max_tokens=8, n=2)], use_tqdm=False)
    assert [c.index for c in out[0].outputs] == [0, 1, 2, 3] and len(out[1].outputs) == 2
    samples = [c.token_ids for c in out[0].outputs]
    assert len({tuple(s) for s in samples}) == 4, samples  # distinct seeds -> distinct samples
    single = llm.generate([PROMPTS[0]] * 4, [SamplingParams(temperature=1.0, max_tokens=8, seed=11 + i)
                                             for i in range(4)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in single] == samples
    assert out[1].outputs[0].token_ids == out[1].outputs[1].token_ids
    assert out[0].outputs[0].cumulative_logprob is not None and single[0].outputs[0].cumulative_logprob is None


@pytest.mark.parametrize("kw,field", [(dict(n=0), "n"), (dict(n=True), "n"), (dict(logprobs=-1), "logprobs"),
                                      (dict(logprobs=True), "logprobs")])
def test_bad_n_and_logprobs_are_refused(kw, field):
    with pytest.raises(RequestError) as e:
        SamplingParams(**kw)
    assert e.value.field == field and f"{field}=" in str(e.value)
