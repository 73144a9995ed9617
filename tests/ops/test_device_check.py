"""CUDA readiness without a GPU (issue 22): the AOT compile check and the device script's dry run.

- `tools/device_check.py --dry-run` (what CI runs): every step printed, every Triton
  kernel AOT-compiled for sm_80 and sm_90a (one specialisation each,
  `aot_cuda_check.py --subset`), registers / spills / smem recorded;
- the AOT check fails on a kernel that does not compile for CUDA (a fixture);
- under `slow`: every kernel x every declared launch specialisation x both archs
  (the table in docs/kernels.md).

Subprocesses without TRITON_INTERPRET (the interpreter compiles nothing); this file
imports no triton.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURE = Path(__file__).parent / "aot_fixtures" / "bad_cuda_kernel.py"


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _jitted_kernels() -> set[str]:
    """Every launched @triton.jit kernel in ops/<family>/triton_*.py: the jit functions minus the
    helpers a module declares in `LOWERING.helpers` (inlined into a kernel, never
    launched, so the AOT check compiles them only as part of their callers)."""
    names, helpers = set(), set()
    for path in sorted((REPO / "ops").glob("*/triton_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
            if isinstance(node, ast.keyword) and node.arg == "helpers":
                helpers |= set(ast.literal_eval(node.value))
    return names - helpers


DEVICE_STEPS = ["env", "kernels", "decode_bandwidth", "dcp_emulation", "compiled_step", "prefill"]


def test_device_check_dry_run(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "tools/device_check.py", "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "device_check.json").read_text())
    steps = data["steps"]
    assert list(steps) == DEVICE_STEPS + ["aot"]
    assert all(s["status"] == "ok" for s in steps.values()), {k: s.get("error") for k, s in steps.items()}
    for name in steps:
        assert f"== step {name} (dry run" in proc.stdout
    assert data["limits_sum_s"] <= 330  # + start-up: the whole run within 6 minutes
    aot = steps["aot"]["rows"]
    assert {(r["kernel"], r["target"]) for r in aot} == {(k, t) for k in _jitted_kernels() for t in ("sm_80", "sm_90a")}
    assert all(r["status"] == "ok" and r["registers"] > 0 for r in aot)
    assert (tmp_path / "device_check.md").read_text().count("### ") == 7


def test_aot_check_fails_on_a_compile_error(tmp_path: Path) -> None:
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "tools.aot_cuda_check", str(FIXTURE), "--arch", "90", "--json", str(out)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["kernel"], r["status"]) for r in rows] == [("_mixed_dot_kernel", "failed")]
    assert "CompilationError" in rows[0]["message"]


@pytest.mark.slow
def test_aot_every_specialisation_both_archs(tmp_path: Path) -> None:
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "tools.aot_cuda_check", "--json", str(out)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=7200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["kernel"] for r in rows} == _jitted_kernels()
    assert {r["target"] for r in rows} == {"sm_80", "sm_90a"}


def test_decode_plan_splits_the_dcp_decode_shape() -> None:
    """`device_check --plan`: launches captured from the registered kernel for an H200
    (nothing runs). The DCP decode shape (batch 8, 8 query heads on 1 KV head, D 128, 32k)
    goes from 8 programs to >= 2 waves of split programs with tl.dot and a split merge."""
    from tools import decode_plan

    rows = {(r["shape"], r["batch"], r["context"], r["variant"]): r for r in decode_plan.plan_rows()}
    key = ("GQA 8 heads per KV head, D 128", 8, 32768)
    before, after = rows[key + ("before",)], rows[key + ("split",)]
    assert before["grid"] == 8 and before["splits"] == 1
    assert after["grid"] >= 2 * decode_plan.SMS and after["splits"] > 1
    kernels = [lc["kernel"] for lc in after["launches"]]
    assert kernels == ["_paged_attention_lse_kernel", "_split_merge_kernel"]
    assert after["launches"][0]["constexprs"]["USE_DOT"] is True
    assert after["launches"][0]["bytes_read"] >= 8 * 32768 * 2 * 128 * 2  # every key's K and V row
    assert after["predicted_fraction_of_4.8TBps"] > 5 * before["predicted_fraction_of_4.8TBps"]
