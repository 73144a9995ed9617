"""Run the steps, each in a forked child with its own time limit; rewrite the JSON after each.

Why a child per step: a step past its limit may sit in a Triton compile or a CUDA
kernel, where no Python-level alarm reaches it. The parent never touches CUDA (only
imports), so each child initialises its own context after the fork; killing a
child (SIGKILL) frees its context and the run goes on with the next step. A step
yields rows; the child appends each to a JSON-lines file as it is made, so a step
that times out keeps the rows it finished.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.devcheck.common import Ctx


@dataclass(frozen=True)
class Step:
    name: str
    limit_s: float  # on the GPU; the rehearsal uses rehearse_limit_s
    rehearse_limit_s: float
    doc: str
    run: Callable[[Ctx], Iterator[dict[str, Any]]]


def _child(step: Step, ctx: Ctx, rows_path: str) -> None:
    code = 0
    with open(rows_path, "w") as f:
        try:
            import torch

            torch.manual_seed(0)
            for row in step.run(ctx):
                f.write(json.dumps(row, default=str) + "\n")
                f.flush()
        except BaseException:  # noqa: BLE001  (recorded, then the child exits non-zero)
            f.write(json.dumps({"_error": traceback.format_exc()[-4000:]}) + "\n")
            code = 1
    os._exit(code)  # no atexit / CUDA teardown that could hang


def cuda_available_in_child() -> bool:
    """torch.cuda.is_available(), asked in a forked child: in this process it would call
    cudaGetDeviceCount, which runs cuInit, and CUDA cannot be used in a child forked after
    that (torch's "poisoned fork"): every step would fail on the GPU machine."""
    def probe() -> None:
        import torch

        os._exit(0 if torch.cuda.is_available() else 3)

    proc = multiprocessing.get_context("fork").Process(target=probe)
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        return False
    return proc.exitcode == 0


def run_step(step: Step, ctx: Ctx, work: Path) -> dict[str, Any]:
    """{status: ok | failed | timed_out, rows, seconds, limit_s[, error]}."""
    limit = step.rehearse_limit_s if ctx.rehearse else step.limit_s
    rows_path = work / f"{step.name}.rows.jsonl"
    t0 = time.perf_counter()
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(step, ctx, str(rows_path)))
    proc.start()
    proc.join(limit)
    timed_out = proc.is_alive()
    if timed_out:
        proc.kill()
        proc.join()
    seconds = time.perf_counter() - t0
    rows, error = [], None
    if rows_path.exists():
        for line in rows_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut by the kill
                continue
            if "_error" in row:
                error = row["_error"]
            else:
                rows.append(row)
        rows_path.unlink()
    if timed_out:
        status, error = "timed_out", f"past its limit of {limit:.0f} s: killed after {len(rows)} rows"
    elif error or proc.exitcode != 0:
        status, error = "failed", error or f"the step's process exited with code {proc.exitcode}"
    elif any(r.get("ok") is False for r in rows):
        status = "failed"
    else:
        status = "ok"
    res: dict[str, Any] = {"status": status, "limit_s": limit, "seconds": round(seconds, 2), "rows": rows}
    if error:
        res["error"] = error
    return res


def markdown(results: dict[str, Any]) -> str:
    lines = []
    for name, res in results["steps"].items():
        lines.append(f"\n### {name} ({res['status']}, {res['seconds']:.1f} s of {res['limit_s']:.0f} s)\n")
        if res.get("error"):
            lines.append("```\n" + res["error"][-1500:] + "\n```")
        rows = res.get("rows") or []
        if not rows:
            continue
        keys = list(dict.fromkeys(k for r in rows for k in r))
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * len(keys))
        lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def write(results: dict[str, Any], out: Path) -> None:
    """The JSON and the markdown table, replaced atomically (a kill mid-write leaves the last)."""
    for name, text in (("device_check.json", json.dumps(results, indent=1, default=str)),
                       ("device_check.md", markdown(results))):
        tmp = out / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(out / name)


def run_all(steps: list[Step], ctx: Ctx, out: Path, header: dict[str, Any], log: Callable[[str], None]) -> bool:
    """Every step in order; the JSON rewritten after each. True when all passed."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {**header, "steps": {}}
    write(results, out)
    ok = True
    for step in steps:
        limit = step.rehearse_limit_s if ctx.rehearse else step.limit_s
        log(f"== step {step.name} (limit {limit:.0f} s): {step.doc}")
        res = run_step(step, ctx, out)
        results["steps"][step.name] = res
        ctx.prior[step.name] = res
        ok &= res["status"] == "ok"
        write(results, out)
        log(f"   {step.name}: {res['status']} ({len(res['rows'])} rows, {res['seconds']:.1f} s)")
        for r in res["rows"]:
            log(f"   {r}")
        if res.get("error"):
            log("   " + res["error"][-1500:].replace("\n", "\n   "))
    results["ok"] = ok
    write(results, out)
    return ok
