"""PD disaggregation through `cp_compile.LLM(..., kv_transfer_config=...)`: two instances.

The producer (P) is a spawned world of 2 CPU gloo ranks at (tp 2, dcp 2, interleave 1,
block 4); the consumer (D) is another instance (here world 1 in this process,
block 8: its own process group state, its own block allocator). P prefills and
exports; D imports each request over NIXL (UCX over DRAM) from both P ranks into its
own blocks and decodes. D's greedy tokens equal HF's `generate` on the checkpoint
(one device); bytes moved equal the formula. A stalled P
rank (SIGSTOPped: alive, never posts its KV) fails the D request within
transfer_timeout_s with the rank named, D's blocks all free, and the next request
decodes exactly. The same two instances behind the HTTP server (`build_app`, uvicorn)
serve vLLM's proxy flow with the real `openai` client: P asked with max_tokens=1
returns `kv_transfer_params`, D given them decodes tokens equal to one device. One
spawn serves every check (module fixture); the reverse layout, D spawned at (tp 2,
dcp 2), and the two `cp-compile serve --kv-transfer-config` processes are `slow`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import torch
import transformers

from cp_compile import LLM, RequestError, SamplingParams
from cp_compile.base.errors import ConfigError
from cp_compile.serving.kv_transfer import KVGeometry, KVLayout, KVTransferError, expected_bytes
from examples.models.tiny import hf_qwen3
from examples.models.tiny_seed import save_checkpoint
from tests.entrypoints.http_util import free_port, wait_healthy

PROMPTS = ["the a of to and", "in is it", "long make thing see him two has look"]
TRANSFER_TIMEOUT_S = 5.0  # the stall case waits this long
GREEDY1 = SamplingParams(temperature=0, max_tokens=1)
GREEDY8 = SamplingParams(temperature=0, max_tokens=8)


def _kv(role: str, port: int, tag: str, **extra) -> dict:
    extra = {"transfer_timeout_s": TRANSFER_TIMEOUT_S, "handoff_timeout_s": 120, **extra}
    if role == "kv_producer":
        return {"kv_role": role, "engine_id": f"prefill-{tag}", "kv_port": port,
                "kv_connector_extra_config": {**extra, "store_master": True}}
    return {"kv_role": role, "engine_id": f"decode-{tag}", "kv_port": port,
            "kv_connector_extra_config": {**extra, "remote_engine_id": f"prefill-{tag}"}}


_HF: dict[str, torch.nn.Module] = {}


def _hf_greedy(path: str, prompts_ids: list[list[int]], n: int) -> list[list[int]]:
    if path not in _HF:
        _HF[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = _HF[path]
    with torch.no_grad():
        return [model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
                for ids in prompts_ids]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    # Dense Qwen3 with one KV head (tp 2 replicates it, dcp 2 shares it): the cheapest
    # GQA checkpoint whose layouts differ on the two sides. One layer: each instance's
    # compile is most of this file's time (layer-by-layer reads run in test_pd_disagg.py).
    return save_checkpoint(hf_qwen3(num_kv_heads=1, num_layers=1), str(tmp_path_factory.mktemp("pd") / "ckpt"))


@pytest.fixture(scope="module")
def pd(ckpt):
    port = free_port()
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
    got = [o.outputs[0].token_ids for o in out]
    print("\nP(tp2,dcp2,I1,bs4) -> D(tp1,dcp1,I1,bs8) tokens:", got, "one device (HF):", ref)
    assert got == ref
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
    # P freed those blocks: the same kv_transfer_params again are refused before any read.
    with pytest.raises(KVTransferError, match="was already imported by a consumer") as e:
        d.generate(PROMPTS[:1], GREEDY8, use_tqdm=False, kv_transfer_params=params[:1])
    assert "Fix: prefill the prompt on the producer again" in str(e.value)
    assert _all_free(d) and all(v == "ok" for v in p.driver.kv_side.verdicts.values())


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


# What vLLM's disaggregation proxy sends the prefill instance.
PROXY_TO_P = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
              "remote_block_ids": None, "remote_host": None, "remote_port": None}


@contextlib.contextmanager
def _served(llm: LLM, name: str):
    """`llm` behind the HTTP server (uvicorn in a thread); yields its base URL."""
    import uvicorn

    from cp_compile.serving.entrypoints.server import build_app

    app = build_app(llm, name)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        while not server.started:
            assert th.is_alive(), "the server thread ended"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        th.join(30)
        app.state.engine.close()  # the driver is the test's again


def _proxy(p_base: str, d_base: str, model: str, prompt: str, max_tokens: int) -> tuple[dict, list[int]]:
    """vLLM's proxy: P with max_tokens=1, its kv_transfer_params to D (real openai client)."""
    import openai

    pc, dc = (openai.OpenAI(base_url=b + "/v1", api_key="none", max_retries=0, timeout=120) for b in (p_base, d_base))
    r = pc.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                              extra_body={"kv_transfer_params": PROXY_TO_P})
    kvp = r.model_extra["kv_transfer_params"]
    r = dc.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                              extra_body={"kv_transfer_params": kvp, "return_token_ids": True})
    return kvp, r.choices[0].model_extra["token_ids"]


def test_http_servers_proxy_flow_equals_one_device(ckpt, pd):
    """P and D behind the HTTP server, vLLM's proxy flow: D's tokens equal one device;
    a bad kv_transfer_params gets HTTP 400 naming the field, before anything runs."""
    openai = pytest.importorskip("openai")
    p, d = pd
    with _served(p, "pd") as p_base, _served(d, "pd") as d_base:
        kvp, got = _proxy(p_base, d_base, "pd", PROMPTS[2], 8)
        assert kvp["do_remote_prefill"] and kvp["remote_engine_id"] == "prefill-a"
        dc = openai.OpenAI(base_url=d_base + "/v1", api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as e:
            dc.completions.create(model="pd", prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                  extra_body={"kv_transfer_params": {**kvp, "remote_engine_id": "prefill-b"}})
        assert "kv_transfer_params.remote_engine_id='prefill-b'" in str(e.value)
        pc = openai.OpenAI(base_url=p_base + "/v1", api_key="none", max_retries=0, timeout=120)
        with pytest.raises(openai.BadRequestError) as e:  # a consumer's params sent to the producer
            pc.completions.create(model="pd", prompt=PROMPTS[2], max_tokens=1, extra_body={"kv_transfer_params": kvp})
        assert "do_remote_decode" in str(e.value)
        # A replayed kv_transfer_params (a client retry): the import fails, HTTP 500 naming the
        # cause, D's blocks free; the server keeps serving.
        with pytest.raises(openai.InternalServerError) as e:
            dc.completions.create(model="pd", prompt=PROMPTS[2], max_tokens=8, temperature=0,
                                  extra_body={"kv_transfer_params": kvp})
        assert "was already imported by a consumer" in str(e.value)
        kvp2, again = _proxy(p_base, d_base, "pd", PROMPTS[0], 8)
    ref = _hf_greedy(ckpt, [d.encode(PROMPTS[2]), d.encode(PROMPTS[0])], 8)
    print("\nHTTP proxy flow P(tp2,dcp2) -> D(tp1) tokens:", [got, again], "one device (HF):", ref)
    assert [got, again] == ref
    _flush(p)
    verdicts = p.driver.kv_side.verdicts
    assert verdicts[kvp["remote_request_id"]] == verdicts[kvp2["remote_request_id"]] == "ok"
    assert _all_free(p) and _all_free(d)


def _cli_server(ckpt: str, kv: dict, *flags: str) -> tuple[subprocess.Popen, str]:
    import json

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cp_compile.serving.entrypoints.cli", "serve", ckpt, "--port", str(port),
                             "--served-model-name", "pd", "--lowering", "eager", "--max-model-len", "64",
                             "--kv-transfer-config", json.dumps(kv), *flags])
    return proc, f"http://127.0.0.1:{port}"


@pytest.mark.slow  # two server processes; the in-process servers above cover the HTTP path by default
def test_serve_kv_transfer_config_two_processes(ckpt):
    port = free_port()
    p, p_base = _cli_server(ckpt, _kv("kv_producer", port, "c"), "--tensor-parallel-size", "2",
                            "--decode-context-parallel-size", "2", "--block-size", "4")
    d = None
    try:
        wait_healthy(p, p_base)  # P hosts the store D connects to
        d, d_base = _cli_server(ckpt, _kv("kv_consumer", port, "c"), "--block-size", "8")
        wait_healthy(d, d_base)
        got = [_proxy(p_base, d_base, "pd", prompt, 8)[1] for prompt in PROMPTS]
    finally:
        for proc in (d, p):
            if proc is not None:
                proc.terminate()
        for proc in (d, p):
            if proc is not None:
                proc.wait(timeout=120)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ref = _hf_greedy(ckpt, [list(tok(x)["input_ids"]) for x in PROMPTS], 8)
    print("\ncp-compile serve P(tp2,dcp2,bs4) -> serve D(tp1,bs8) tokens:", got, "one device (HF):", ref)
    assert got == ref


def test_bad_kv_transfer_config_refused_before_any_process(ckpt):
    for cfg, needle in [({"kv_role": "kv_both", "kv_port": 5600}, "kv_role='kv_both'"),
                        ({"kv_role": "kv_consumer", "kv_port": 5600}, "no remote_engine_id"),
                        ({"kv_role": "kv_producer"}, "kv_port=0"),
                        ({"kv_role": "kv_producer", "kv_port": 5600,
                          "kv_connector_extra_config": {"handoff_timeout": 5}}, "unknown keys ['handoff_timeout']")]:
        with pytest.raises(ConfigError, match="Fix: ") as e:
            LLM(model=ckpt, tensor_parallel_size=2, kv_transfer_config=cfg)
        assert needle in str(e.value)
    # `cp-compile serve --kv-transfer-config`: the same refusal, and JSON that is not an object.
    from cp_compile.serving.entrypoints.cli import main

    with pytest.raises(ConfigError, match="kv_role='kv_both'"):
        main(["serve", ckpt, "--tensor-parallel-size", "2", "--kv-transfer-config",
              '{"kv_role": "kv_both", "kv_port": 5600}'])
    with pytest.raises(SystemExit):
        main(["serve", ckpt, "--kv-transfer-config", "{kv_role: kv_producer}"])


@pytest.mark.slow  # the default cases cover the LLM path; this one spawns the consumer (D ranks agree)
def test_spawned_consumer_tp2_dcp2(ckpt):
    port = free_port()
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


@pytest.mark.slow  # one spawn + two compiles per kind; the GQA default cases cover the LLM role path
@pytest.mark.parametrize("kind", ["deepseek_v2_lite", "deepseek_v32"])  # MLA latent; SFA latent + indexer
def test_llm_roles_mla_sfa(kind, tmp_path):
    from examples.models.tiny_seed import tiny_seed_model

    path = save_checkpoint(tiny_seed_model(kind), str(tmp_path / kind))
    port = free_port()
    with LLM(model=path, tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4, lowering="eager",
             max_model_len=64, kv_transfer_config=_kv("kv_producer", port, kind)) as p, \
            LLM(model=path, block_size=8, lowering="eager", max_model_len=64,
                kv_transfer_config=_kv("kv_consumer", port, kind)) as d:
        pre = p.generate(PROMPTS, GREEDY1, use_tqdm=False)
        out = d.generate(PROMPTS, GREEDY8, use_tqdm=False, kv_transfer_params=[o.kv_transfer_params for o in pre])
        got = [o.outputs[0].token_ids for o in out]
        ref = _hf_greedy(path, [o.prompt_token_ids for o in out], 8)
        print(f"\n{kind}: P(tp2,dcp2,bs4) -> D(tp1,bs8) tokens:", got, "one device (HF):", ref)
        assert got == ref
        _flush(p)
        assert all(v == "ok" for v in p.driver.kv_side.verdicts.values()) and _all_free(d) and _all_free(p)


def _post(base: str, body: dict, timeout: float) -> tuple[int, dict]:
    """POST /v1/completions with the standard library: (status, JSON body), errors included."""
    import json
    import urllib.error

    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_producer_server_gone_fails_the_decode_request_and_decode_keeps_serving(ckpt):
    """Issue 35 item 5. P (`cp-compile serve`, one process) hosts the store. P stops
    (SIGSTOP: the store hangs) with a request exported: D answers its import with HTTP
    500 within a bounded time (no store call waits longer than transfer_timeout_s);
    P resumes and D serves the next request from it (reconnected). Then P dies (SIGKILL:
    its store with it) with another request exported: D answers HTTP 500 naming the
    store's DistNetworkError. D's blocks are all free and it serves a request of its
    own: D's engine never dies on P's store."""
    port = free_port()
    p, p_base = _cli_server(ckpt, _kv("kv_producer", port, "gone"), "--block-size", "4")

    def export(prompt: str) -> dict:  # prefilled and exported by P, not imported yet
        status, body = _post(p_base, {"model": "pd", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                      "kv_transfer_params": PROXY_TO_P}, timeout=120)
        assert status == 200, body
        return body["kv_transfer_params"]

    try:
        wait_healthy(p, p_base)
        with LLM(model=ckpt, block_size=8, lowering="eager", max_model_len=64,
                 kv_transfer_config=_kv("kv_consumer", port, "gone")) as d, _served(d, "pd") as d_base:
            _, first = _proxy(p_base, d_base, "pd", PROMPTS[0], 4)  # D has met P (its ranks, its agents)
            kvp = export(PROMPTS[1])
            os.kill(p.pid, signal.SIGSTOP)  # alive, silent: a store call on it blocks forever
            t0 = time.monotonic()
            try:
                status, body = _post(d_base, {"model": "pd", "prompt": PROMPTS[1], "max_tokens": 4,
                                              "kv_transfer_params": kvp}, timeout=60)
            finally:
                os.kill(p.pid, signal.SIGCONT)
            stalled_s = time.monotonic() - t0
            msg = body["error"]["message"]
            print(f"\nP stopped: D answered {status} after {stalled_s:.1f} s: {msg}")
            assert status == 500 and "KV import failed" in msg and "did not answer within" in msg
            assert f"transfer_timeout_s={TRANSFER_TIMEOUT_S}" in msg and "its decode blocks were freed" in msg
            assert stalled_s < 4 * TRANSFER_TIMEOUT_S + 10
            _, again = _proxy(p_base, d_base, "pd", PROMPTS[2], 4)  # P is back: D reconnects to its store
            kvp = export(PROMPTS[1])
            os.kill(p.pid, signal.SIGKILL)  # the whole P server dies, its store with it
            p.wait(timeout=30)
            t0 = time.monotonic()
            status, body = _post(d_base, {"model": "pd", "prompt": PROMPTS[1], "max_tokens": 4,
                                          "kv_transfer_params": kvp}, timeout=60)
            msg = body["error"]["message"]
            print(f"P killed: D answered {status} after {time.monotonic() - t0:.1f} s: {msg}")
            assert status == 500 and "KV import failed" in msg and "failed (DistNetworkError" in msg
            assert "Fix: check that producer 'prefill-gone' is up" in msg and "its decode blocks were freed" in msg
            with urllib.request.urlopen(d_base + "/health", timeout=10) as r:
                assert r.status == 200
            status, body = _post(d_base, {"model": "pd", "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0,
                                          "return_token_ids": True}, timeout=120)  # prefilled on D itself
            assert status == 200, body
            own = body["choices"][0]["token_ids"]
        assert _all_free(d)
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
    tok = transformers.AutoTokenizer.from_pretrained(ckpt)
    ref = _hf_greedy(ckpt, [list(tok(x)["input_ids"]) for x in (PROMPTS[0], PROMPTS[2])], 4)
    assert [first, again] == ref and own == ref[0]


@pytest.mark.slow  # the finding's topology: D spawned at (tp 2, dcp 2), where rank 0 died and rank 1 spun
def test_producer_server_killed_spawned_consumer_fails_the_request_and_keeps_serving(ckpt):
    port = free_port()
    p, p_base = _cli_server(ckpt, _kv("kv_producer", port, "gone2"), "--block-size", "4")
    try:
        wait_healthy(p, p_base)
        with LLM(model=ckpt, tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4,
                 lowering="eager", max_model_len=64, kv_transfer_config=_kv("kv_consumer", port, "gone2")) as d:
            def export(prompt: str) -> dict:
                status, body = _post(p_base, {"model": "pd", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                                              "kv_transfer_params": PROXY_TO_P}, timeout=120)
                assert status == 200, body
                return body["kv_transfer_params"]

            first = d.generate(PROMPTS[:1], GREEDY8, use_tqdm=False, kv_transfer_params=[export(PROMPTS[0])])
            kvp = export(PROMPTS[1])
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
            with pytest.raises(KVTransferError, match="failed \\(DistNetworkError") as e:
                d.generate(PROMPTS[1:2], GREEDY8, use_tqdm=False, kv_transfer_params=[kvp])
            print(f"\nP killed: spawned D (tp 2, dcp 2) raised: {e.value}")
            assert "its decode blocks were freed" in str(e.value)
            assert _all_free(d)  # both ranks answered (neither died) and freed the request's blocks
            own = d.generate(PROMPTS[:1], GREEDY8, use_tqdm=False)  # prefilled on D itself
        assert own[0].outputs[0].token_ids == first[0].outputs[0].token_ids == \
            _hf_greedy(ckpt, [own[0].prompt_token_ids], 8)[0]
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
