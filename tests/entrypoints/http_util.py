"""Shared by the tests that start `cp-compile serve` processes: a free port, and the wait
for a server's /health."""

from __future__ import annotations

import subprocess
import time
import urllib.request

from cp_compile.serving.entrypoints.executors import free_port

__all__ = ["free_port", "wait_healthy"]


def wait_healthy(proc: subprocess.Popen, base: str, deadline_s: float = 600) -> None:
    """Return once `base`/health answers; raise if the process exits or the deadline passes."""
    deadline = time.time() + deadline_s
    while True:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"server {base} did not start (exit {proc.poll()})")
            time.sleep(0.5)
