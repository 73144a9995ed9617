"""Issue 35 item 6: an engine worker dies while a request is in flight.

A real `cp-compile serve` process at tp 2 (two spawned worker ranks); a streaming
request is running when worker rank 1 is SIGKILLed. The client gets an error event
within seconds (not a hang), `/health` answers 503 naming the dead rank, and the
server process exits non-zero within a bounded time, for a process manager to
restart it (docs/decisions.md, the entry on engine failure).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from examples.models.tiny import hf_qwen3
from examples.models.tiny_seed import save_checkpoint
from tests.entrypoints.http_util import free_port, wait_healthy

EXIT_WITHIN_S = 60.0  # the server's grace for /health readers (5 s) plus teardown of the surviving rank


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_checkpoint(hf_qwen3(num_kv_heads=1, num_layers=1), str(tmp_path_factory.mktemp("wd") / "ckpt"))


def _health(base: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_worker_killed_mid_request_errors_the_request_and_the_server_exits(ckpt):
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "cp_compile.serving.entrypoints.cli", "serve", ckpt, "--port",
                             str(port), "--served-model-name", "wd", "--lowering", "eager", "--max-model-len", "64",
                             "--tensor-parallel-size", "2", "--block-size", "4"])
    try:
        wait_healthy(proc, base)
        status, body = _health(base)
        pids = body.get("worker_pids")
        assert status == 200 and isinstance(pids, list) and len(pids) == 2, body
        plain: dict = {}  # a non-streaming request in flight at the same time

        def post_plain() -> None:
            r = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                       data=json.dumps({"model": "wd", "prompt": "in is it", "max_tokens": 56,
                                                        "ignore_eos": True}).encode())
            try:
                with urllib.request.urlopen(r, timeout=30) as resp:
                    plain.update(status=resp.status, body=json.loads(resp.read()))
            except urllib.error.HTTPError as e:
                plain.update(status=e.code, body=json.loads(e.read()), at=time.monotonic())

        th = threading.Thread(target=post_plain)
        th.start()
        req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "wd", "prompt": "the a of to", "max_tokens": 56,
                                                      "ignore_eos": True, "stream": True}).encode())
        events: list[str] = []
        with urllib.request.urlopen(req, timeout=30) as r:
            first = r.readline()  # the first token is out: the request is running
            assert first.startswith(b"data: "), first
            os.kill(pids[1], signal.SIGKILL)
            t0 = time.monotonic()
            for line in r:  # the stream must end (with an error event) instead of hanging
                if line.startswith(b"data: "):
                    events.append(line[6:].decode().strip())
            answered_s = time.monotonic() - t0
        th.join(30)
        assert plain.get("status") == 503, plain  # answered with the error, not left to the client's timeout
        assert "worker rank 1" in plain["body"]["error"]["message"] and plain["at"] - t0 < 20
        errors = [json.loads(e)["error"]["message"] for e in events if e.startswith('{"error"')]
        print(f"\nworker rank 1 killed: the stream ended after {answered_s:.1f} s with {errors}")
        assert errors and "worker rank 1" in errors[0] and answered_s < 20
        status, body = _health(base)
        print("/health:", status, body)
        assert status == 503 and "worker rank 1" in body["error"]["message"]
        assert "Fix: restart the server" in body["error"]["message"]
        code = proc.wait(timeout=EXIT_WITHIN_S)
        print(f"the server exited with code {code} {time.monotonic() - t0:.1f} s after the kill")
        assert code == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_worker_killed_while_idle_health_says_why_and_the_server_exits(ckpt):
    """No request runs: the engine loop itself notices the dead worker (no step would)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "cp_compile.serving.entrypoints.cli", "serve", ckpt, "--port",
                             str(port), "--served-model-name", "wd", "--lowering", "eager", "--max-model-len", "64",
                             "--tensor-parallel-size", "2", "--block-size", "4"])
    try:
        wait_healthy(proc, base)
        status, body = _health(base)
        assert status == 200, body
        os.kill(body["worker_pids"][0], signal.SIGKILL)
        t0 = time.monotonic()
        while (status := _health(base)[0]) == 200 and time.monotonic() - t0 < 10:
            time.sleep(0.2)
        status, body = _health(base)
        print(f"\nidle, worker rank 0 killed: /health {status} after {time.monotonic() - t0:.1f} s: {body}")
        assert status == 503 and "worker rank 0" in body["error"]["message"]
        assert proc.wait(timeout=EXIT_WITHIN_S) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
