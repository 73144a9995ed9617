"""`--dry-run` (CI, no GPU): every step's plan with its limit, and the AOT compile of
every Triton kernel for sm_80 / sm_90a (tools/aot_cuda_check.py --subset)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tools.devcheck.repo_imports import REPO
from tools.devcheck.runner import write


def aot_rows() -> list[dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"aot_{os.getpid()}.json"
    proc = subprocess.run([sys.executable, "-m", "tools.aot_cuda_check", "--subset", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0:
        raise RuntimeError(f"AOT compile failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    rows = json.loads(out.read_text())["results"]
    out.unlink()
    return [{k: r[k] for k in ("kernel", "arch", "target", "registers", "spill_stores", "smem_dynamic", "status")}
            for r in rows]


def main(steps: list, out: Path) -> int:
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"mode": "dry-run", "steps": {}}
    for s in steps:
        print(f"== step {s.name} (dry run, limit {s.limit_s:.0f} s): {s.doc}", flush=True)
        results["steps"][s.name] = {"status": "ok", "limit_s": s.limit_s, "seconds": 0.0,
                                    "rows": [{"status": "dry run", "doc": s.doc}]}
    print("== step aot (dry run): every Triton kernel AOT-compiled for sm_80 and sm_90a", flush=True)
    try:
        rows = aot_rows()
        bad = [r for r in rows if r["status"] != "ok"]
        results["steps"]["aot"] = {"status": "failed" if bad else "ok", "limit_s": 1200, "seconds": 0.0, "rows": rows}
    except Exception as exc:  # noqa: BLE001
        results["steps"]["aot"] = {"status": "failed", "limit_s": 1200, "seconds": 0.0, "rows": [], "error": str(exc)}
    results["limits_sum_s"] = sum(s.limit_s for s in steps)
    write(results, out)
    ok = all(r["status"] == "ok" for r in results["steps"].values())
    print(f"{'ok' if ok else 'FAILED'}; wrote {out / 'device_check.json'}", flush=True)
    return 0 if ok else 1
