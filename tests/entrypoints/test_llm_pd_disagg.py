"""PD disaggregation through `cp_compile.LLM(..., kv_transfer_config=...)`: two instances.

The producer (P) is a spawned world of 2 CPU gloo ranks at (tp 2, dcp 2, interleave 1,
block 4); the consumer (D) is another instance (here world 1 in this process,
block 8: its own process group state, its own block allocator). P prefills and
exports; D imports each request over NIXL (UCX over DRAM) from both P ranks into its
own blocks and decodes. D's greedy tokens equal HF's `generate` on the checkpoint
(one device) and D's own local prefill; bytes moved equal the formula. A stalled P
rank (SIGSTOPped: alive, never posts its KV) fails the D request within
transfer_timeout_s with the rank named, D's blocks all free, and the next request
decodes exactly. One spawn serves every check (module fixture); the reverse layout,
D spawned at (tp 2, dcp 2), is `slow`.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch
import transformers

from cp_compile import LLM, RequestError, SamplingParams
from cp_compile.errors import ConfigError
from cp_compile.kv_transfer import KVGeometry, KVLayout, KVTransferError, expected_bytes
from examples.models.tiny import hf_qwen3
from examples.models.tiny_seed import save_checkpoint

PROMPTS = ["the a of to and", "in is it", "long make thing see him two has look"]
TRANSFER_TIMEOUT_S = 8.0
GREEDY1 = SamplingParams(temperature=0, max_tokens=1)
GREEDY8 = SamplingParams(temperature=0, max_tokens=8)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kv(role: str, port: int, tag: str, **extra) -> dict:
    extra = {"transfer_timeout_s": TRANSFER_TIMEOUT_S, "handoff_timeout_s": 120, **extra}
    if role == "kv_producer":
        return {"kv_role": role, "engine_id": f"prefill-{tag}", "kv_port": port,
                "kv_connector_extra_config": {**extra, "store_master": True}}
    return {"kv_role": role, "engine_id": f"decode-{tag}", "kv_port": port,
            "kv_connector_extra_config": {**extra, "remote_engine_id": f"prefill-{tag}"}}


def _hf_greedy(path: str, prompts_ids: list[list[int]], n: int) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
                for ids in prompts_ids]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    # Dense Qwen3 with one KV head (tp 2 replicates it, dcp 2 shares it): the cheapest
    # GQA checkpoint whose layouts differ on the two sides.
    return save_checkpoint(hf_qwen3(num_kv_heads=1), str(tmp_path_factory.mktemp("pd") / "ckpt"))


@pytest.fixture(scope="module")
def pd(ckpt):
    port = _free_port()
    with LLM(model=ckpt, tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4, lowering="eager",
             max_model_len=64, kv_transfer_config=_kv("kv_producer", port, "a")) as p, \
            LLM(model=ckpt, block_size=8, lowering="eager", max_model_len=64,
                kv_transfer_config=_kv("kv_consumer", port, "a")) as d:
        yield p, d


def _flush(llm: LLM) -> None:
    """Let the producer free what the consumer is done with (as its next step does)."""
    llm.driver.kv_side.release_consumed(llm.driver.scheduler)
    llm.driver.drop([])


def _all_free(llm: LLM) -> bool:
    return all(b["free"] == b["num_blocks"] and not b["quarantined"] for b in llm.kv_blocks)


def test_decode_instance_tokens_equal_one_device(ckpt, pd):
    p, d = pd
    pre = p.generate(PROMPTS, GREEDY1, use_tqdm=False)
    params = [o.kv_transfer_params for o in pre]
    assert all(k["do_remote_prefill"] and k["remote_engine_id"] == "prefill-a" for k in params)
    out = d.generate(PROMPTS, GREEDY8, use_tqdm=False, kv_transfer_params=params)
    ids = [o.prompt_token_ids for o in out]
    ref = _hf_greedy(ckpt, ids, 8)
    local = [o.outputs[0].token_ids for o in d.generate(PROMPTS, GREEDY8, use_tqdm=False)]  # D prefills itself
    got = [o.outputs[0].token_ids for o in out]
    print("\nP(tp2,dcp2,I1,bs4) -> D(tp1,dcp1,I1,bs8) tokens:", got, "one device (HF):", ref)
    assert got == ref == local
    assert [o.outputs[0].token_ids[0] for o in pre] == [g[0] for g in got]  # P's token starts D's output
    # Bytes moved == the formula (every token once), from both P ranks.
    hf_config = transformers.AutoConfig.from_pretrained(ckpt)
    geometry = KVGeometry(kind="gqa", num_layers=hf_config.num_hidden_layers,
                          num_kv_heads=hf_config.num_key_value_heads, head_dim=hf_config.head_dim,
                          v_head_dim=hf_config.head_dim)
    layout = KVLayout(1, 1, 1, 1, 8)
    imports = d.driver.kv_side.imports
    for o, rid in zip(out, sorted(imports)[-len(out):]):
        moved = sum(r["bytes_moved"] for r in imports[rid])
        assert moved == expected_bytes(geometry, layout, len(o.prompt_token_ids)) > 0
        assert imports[rid][0]["src_ranks"] == (0, 1)
    _flush(p)
    assert all(v == "ok" for v in p.driver.kv_side.verdicts.values()) and not p.driver.kv_side.held
    assert _all_free(p) and _all_free(d)


def test_stalled_prefill_rank_fails_the_decode_request(ckpt, pd):
    """P rank 1 is stopped (SIGSTOP: alive, silent) after its prefill, before it posts
    the request: D fails it within transfer_timeout_s of rank 0's report, naming rank 1;
    nothing stays allocated on D; once rank 1 runs again the next request is exact."""
    p, d = pd
    victim = p.executor.procs[1].pid
    real_call = p.executor.call

    def stalling_call(kind, payload, *a, **k):
        if kind == "kv_export":
            box["rid"] = payload[0][0]
            os.kill(victim, signal.SIGSTOP)
        return real_call(kind, payload, *a, **k)

    box: dict = {}
    p.executor.call = stalling_call
    th = threading.Thread(target=lambda: box.update(pre=p.generate(PROMPTS[:1], GREEDY1, use_tqdm=False)))
    th.start()
    try:
        # D learns the request id from P's output in a deployment; P is blocked on the
        # stopped rank here, so the test takes it from the export P is posting.
        while "rid" not in box and th.is_alive():
            time.sleep(0.05)
        remote = box["rid"]
        params = {"do_remote_prefill": True, "remote_engine_id": "prefill-a", "remote_request_id": remote,
                  "num_tokens": len(d.encode(PROMPTS[0]))}
        t0 = time.monotonic()
        with pytest.raises(KVTransferError) as e:
            d.generate(PROMPTS[:1], GREEDY8, use_tqdm=False, kv_transfer_params=[params])
        took = time.monotonic() - t0
    finally:
        os.kill(victim, signal.SIGCONT)
        p.executor.call = real_call
        th.join(120)
    msg = str(e.value)
    print(f"\nstall: D failed after {took:.1f} s: {msg}")
    assert "producer rank(s) [1] did not report it ready" in msg and f"transfer_timeout_s={TRANSFER_TIMEOUT_S}" in msg
    assert "its decode blocks were freed" in msg
    assert took < 60  # bounded: transfer_timeout_s after rank 0's report, plus P's prefill
    assert _all_free(d)
    _flush(p)
    assert p.driver.kv_side.verdicts[remote].startswith("failed: ") and _all_free(p)
    # The instances still serve: the next request decodes exactly.
    pre = p.generate(PROMPTS[1:2], GREEDY1, use_tqdm=False)
    out = d.generate(PROMPTS[1:2], GREEDY8, use_tqdm=False, kv_transfer_params=[pre[0].kv_transfer_params])
    assert out[0].outputs[0].token_ids == _hf_greedy(ckpt, [out[0].prompt_token_ids], 8)[0]


def test_bad_requests_refused_before_anything_runs(pd):
    p, d = pd
    steps = (p.driver.steps, d.driver.steps)
    with pytest.raises(RequestError, match="max_tokens=8.*SamplingParams\\(max_tokens=1\\)"):
        p.generate(PROMPTS[:1], GREEDY8, use_tqdm=False)
    good = {"do_remote_prefill": True, "remote_engine_id": "prefill-a", "remote_request_id": 0, "num_tokens": 5}
    for bad, needle in [({**good, "remote_engine_id": "prefill-b"}, "remote_engine_id='prefill-b'"),
                        ({**good, "num_tokens": 4}, "num_tokens=4"),
                        ({**good, "remote_request_id": -1}, "remote_request_id=-1"),
                        ({**good, "block_ids": [0]}, "unknown keys")]:
        with pytest.raises(RequestError, match="Fix|keys are|is the producer") as e:
            d.generate(PROMPTS[:1], GREEDY8, use_tqdm=False, kv_transfer_params=[bad])
        assert needle in str(e.value)
    with pytest.raises(RequestError, match="logprobs"):
        d.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False,
                   kv_transfer_params=[good])
    assert (p.driver.steps, d.driver.steps) == steps and _all_free(d)


def test_bad_kv_transfer_config_refused_before_any_process(ckpt):
    for cfg, needle in [({"kv_role": "kv_both", "kv_port": 5600}, "kv_role='kv_both'"),
                        ({"kv_role": "kv_consumer", "kv_port": 5600}, "no remote_engine_id"),
                        ({"kv_role": "kv_producer"}, "kv_port=0"),
                        ({"kv_role": "kv_producer", "kv_port": 5600,
                          "kv_connector_extra_config": {"handoff_timeout": 5}}, "unknown keys ['handoff_timeout']")]:
        with pytest.raises(ConfigError, match="Fix: ") as e:
            LLM(model=ckpt, tensor_parallel_size=2, kv_transfer_config=cfg)
        assert needle in str(e.value)


@pytest.mark.slow  # the default cases cover the LLM path; this one spawns the consumer (D ranks agree)
def test_spawned_consumer_tp2_dcp2(ckpt):
    port = _free_port()
    with LLM(model=ckpt, block_size=8, lowering="eager", max_model_len=64,
             kv_transfer_config=_kv("kv_producer", port, "b")) as p, \
            LLM(model=ckpt, tensor_parallel_size=2, decode_context_parallel_size=2, cp_kv_cache_interleave_size=4,
                block_size=4, lowering="eager", max_model_len=64, kv_transfer_config=_kv("kv_consumer", port, "b")) as d:
        pre = p.generate(PROMPTS, GREEDY1, use_tqdm=False)
        out = d.generate(PROMPTS, GREEDY8, use_tqdm=False, kv_transfer_params=[o.kv_transfer_params for o in pre])
        got = [o.outputs[0].token_ids for o in out]
        print("\nP(tp1,dcp1,I1,bs8) -> D(tp2,dcp2,I4,bs4) tokens:", got)
        assert got == _hf_greedy(ckpt, [o.prompt_token_ids for o in out], 8)
        _flush(p)
        assert all(v == "ok" for v in p.driver.kv_side.verdicts.values()) and _all_free(d) and _all_free(p)
