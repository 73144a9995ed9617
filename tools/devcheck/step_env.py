"""Step env: the machine and the streaming roof (a device-to-device copy's GB/s)."""

from __future__ import annotations

import platform
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import torch

from tools.devcheck.common import Ctx, graph_time

COPY_BYTES = 2 * 2**30  # per buffer: far past the 60 MB L2


def _clocks() -> dict[str, Any]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"clocks": "nvidia-smi not found"}
    q = "clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,driver_version,power.limit"
    proc = subprocess.run([smi, f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True,
                          timeout=20)
    if proc.returncode != 0:
        return {"clocks": f"nvidia-smi failed: {proc.stderr.strip()[:200]}"}
    return dict(zip(q.split(","), (v.strip() for v in proc.stdout.splitlines()[0].split(","))))


def run(ctx: Ctx) -> Iterator[dict[str, Any]]:
    import triton

    from tools.devcheck.repo_imports import ensure_repo_importable

    row: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "triton": triton.__version__, "torch_cuda": torch.version.cuda,
                           "cp_compile_ops": ensure_repo_importable(), "rehearse": ctx.rehearse}
    if not ctx.cuda:
        row["d2d_copy"] = "skipped: rehearsal on CPU (no device to copy on)"
        yield row
        return
    p = torch.cuda.get_device_properties(0)
    row.update(gpu=p.name, sms=p.multi_processor_count, mem_GiB=round(p.total_memory / 2**30, 1),
               capability=f"{p.major}.{p.minor}", l2_MB=round(getattr(p, "L2_cache_size", 0) / 2**20, 1))
    row.update(_clocks())
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = graph_time(lambda: dst.copy_(src), iters=10)
    row["d2d_copy_GBps"] = 2 * COPY_BYTES / (t["us"] * 1e-6) / 1e9  # read + write
    row["d2d_copy_us"], row["d2d_copy_spread_us"] = t["us"], [t["us_min"], t["us_max"]]
    yield row
