"""Issue 35 item 5, at the exchange layer: the TCPStore the producer hosts goes away.

The store's server runs in a child process (as in P's driver); a consumer-side
`Exchange` is connected to it. Killed (SIGKILL: the store is gone) or stopped
(SIGSTOP: it never answers), every call the consumer makes raises `KVTransferError`
naming the store and the fix, within call_timeout_s: never torch's DistNetworkError
(which killed D's rank 0 in the finding) and never a hang (a TCPStore client blocks
in recv forever on a stopped server, whatever its timeout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable

import pytest

from cp_compile.serving.kv_transfer.exchange import Exchange
from cp_compile.serving.kv_transfer.transport import KVTransferError
from tests.entrypoints.http_util import free_port

CALL_TIMEOUT_S = 2.0


def _store_process(port: int) -> subprocess.Popen:
    code = ("import time; from torch.distributed import TCPStore; "
            f"s = TCPStore('127.0.0.1', {port}, is_master=True, wait_for_workers=False); "
            "print('up', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"up"
    return proc


def _bounded(fn: Callable[[], Any], limit_s: float) -> tuple[BaseException | None, float]:
    """Run fn in a thread (a hang fails the test instead of blocking it): its exception, seconds."""
    box: dict[str, Any] = {}

    def go() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - checked by the caller
            box["exc"] = exc

    t0 = time.monotonic()
    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(limit_s)
    assert not th.is_alive(), f"the store call still blocks after {limit_s} s"
    return box.get("exc"), time.monotonic() - t0


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_consumer_store_calls_fail_with_kv_transfer_error(how):
    port = free_port()
    proc = _store_process(port)
    try:
        ex = Exchange("127.0.0.1", port, "prefill-x", timeout_s=10, call_timeout_s=CALL_TIMEOUT_S)
        ex.publish_consumed(7, "ok")  # connected and working
        assert ex.poll_consumed(7) == "ok"
        os.kill(proc.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        if how == "killed":
            proc.wait(10)
        calls = {"fetch_ready": lambda: ex.fetch_ready(3, 2, 60.0, 60.0),
                 "claim": lambda: ex.claim(3),
                 "publish_consumed": lambda: ex.publish_consumed(3, "failed: ..."),
                 "poll_consumed": lambda: ex.poll_consumed(3)}
        for name, call in calls.items():
            exc, took = _bounded(call, 4 * CALL_TIMEOUT_S + 10)
            print(f"\nstore {how}: {name} raised {type(exc).__name__} after {took:.1f} s: {exc}")
            assert isinstance(exc, KVTransferError), f"{name}: {type(exc).__name__}: {exc}"
            assert f"the KV-transfer store at 127.0.0.1:{port}" in str(exc)
            assert "Fix: check that producer 'prefill-x' is up" in str(exc)
            assert took < 2 * CALL_TIMEOUT_S + 5
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
