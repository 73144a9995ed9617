"""The device check rehearsed on CPU (issue 36 items 4-6, decision 59).

`tools/device_check.py --rehearse` runs the GPU check's steps at tiny shapes under
TRITON_INTERPRET=1. Here it runs in the device machine's environment as far as this
machine has it (`tools/device_python.sh`: triton 3.6.0 from .venv-device, .venv's CPU
torch, no site-packages, so the repository imports through the tool's shim exactly as
on the bare GPU machine). Default: the env and kernels steps (every cp:: op through
dispatch, ~30 s); `slow`: every step, in both environments. Also: the step runner's
time limit, the NaN comparison, and the torchrun script under gloo on 2 ranks.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DEVICE_PY = REPO / "tools" / "device_python.sh"
STEPS = ["env", "kernels", "decode_bandwidth", "dcp_emulation", "compiled_step", "prefill"]


def _rehearse(tmp_path: Path, python: list[str], only: list[str]) -> dict:
    if python[0] == str(DEVICE_PY) and not (REPO / ".venv-device" / "triton").is_dir():
        pytest.fail("no .venv-device (triton 3.6.0, the GPU machine's): run `bash tools/bootstrap.sh` "
                    "(the README's test command does)")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    cmd = python + ["tools/device_check.py", "--rehearse", "--out", str(tmp_path)] + sum((["--only", o] for o in only), [])
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert list(data["steps"]) == only and data["ok"] is True
    return data


def _check_kernels(data: dict) -> None:
    from cp_compile.testing.op_cases import op_cases

    rows = data["steps"]["kernels"]["rows"]
    edge = {(r["op"], r["dtype"]) for r in rows if r["case"] == "edge: op_cases"}
    assert edge == {(op, dt) for op in op_cases("cpu") for dt in ("float32", "float16")}
    assert sum(r["case"].startswith("production") for r in rows) == 4
    assert all(r["ok"] and math.isfinite(r["max_err"]) for r in rows)


def test_rehearsal_on_the_device_triton(tmp_path: Path) -> None:
    """triton 3.6.0, nothing installed: the repository imports through the shim, and every
    op's registered CUDA kernel (under the interpreter) matches its reference."""
    data = _rehearse(tmp_path, [str(DEVICE_PY)], ["env", "kernels"])
    env = data["steps"]["env"]["rows"][0]
    assert env["triton"] == "3.6.0" and env["cp_compile_ops"] == "repo-root shim"
    _check_kernels(data)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["device_triton", "venv"])
def test_full_rehearsal(tmp_path: Path, where: str) -> None:
    python = [str(DEVICE_PY)] if where == "device_triton" else [sys.executable]
    data = _rehearse(tmp_path, python, STEPS)
    _check_kernels(data)
    steps = data["steps"]
    assert all(r["timing"].startswith("skipped: rehearsal") for r in steps["decode_bandwidth"]["rows"])
    assert {r["ranks"] for r in steps["dcp_emulation"]["rows"]} == {2, 4}
    assert all(r["graph"].startswith("skipped") for r in steps["dcp_emulation"]["rows"] + steps["compiled_step"]["rows"])


def _sleepy(ctx):
    yield {"n": 1, "ok": True}
    time.sleep(60)
    yield {"n": 2, "ok": True}


def _fine(ctx):
    yield {"n": 3, "ok": True}


def test_a_step_past_its_limit_is_killed_and_the_run_goes_on(tmp_path: Path) -> None:
    from tools.devcheck.common import Ctx
    from tools.devcheck.runner import Step, run_all

    steps = [Step("slow", 2, 2, "sleeps past its limit", _sleepy), Step("next", 20, 20, "runs after it", _fine)]
    t0 = time.perf_counter()
    ok = run_all(steps, Ctx(torch.device("cpu"), True), tmp_path, {}, lambda m: None)
    assert time.perf_counter() - t0 < 30
    data = json.loads((tmp_path / "device_check.json").read_text())
    assert not ok and data["steps"]["slow"]["status"] == "timed_out"
    assert data["steps"]["slow"]["rows"] == [{"n": 1, "ok": True}]  # the rows before the kill are kept
    assert data["steps"]["next"]["status"] == "ok"


def test_nan_and_inf_fail_the_comparison() -> None:
    from tools.devcheck.common import max_err, within, worst

    want = torch.ones(4)
    for bad in (float("nan"), float("inf")):
        got = want.clone()
        got[2] = bad
        assert math.isnan(max_err(got, want)) and not within(max_err(got, want), torch.float32)
    assert math.isnan(worst([0.0, math.nan, 0.5]))  # max(err, nan) would keep 0.5
    minus = torch.tensor([float("-inf"), 1.0])
    assert max_err(minus.clone(), minus) == 0.0  # an empty shard's -inf LSE on both sides is fine
    assert within(max_err(want + 1e-6, want), torch.float32)


def test_torchrun_dcp_step_on_two_gloo_ranks() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "tools/dcp_multi_gpu.py", "--device", "cpu", "--iters", "2"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert out["world"] == 2 and out["ok"] is True
    assert {(r["rank"], r["merge"]) for r in out["rows"]} == {(0, "ag_rs"), (0, "a2a"), (1, "ag_rs"), (1, "a2a")}
    assert all(r["max_err_vs_one_device"] <= 1e-5 for r in out["rows"])


_SPY = """
import json, os, sys
sys.path.insert(0, {repo!r})
import torch
parent, calls = os.getpid(), []
def spy(name, fn):
    def wrapped(*a, **k):
        if os.getpid() == parent:
            calls.append(name)
        return fn(*a, **k)
    return wrapped
torch.cuda.is_available = spy("is_available", torch.cuda.is_available)
torch.cuda.device_count = spy("device_count", torch.cuda.device_count)
if hasattr(torch._C, "_cuda_getDeviceCount"):  # CUDA builds only
    torch._C._cuda_getDeviceCount = spy("_cuda_getDeviceCount", torch._C._cuda_getDeviceCount)
from tools import device_check
rc = device_check.main(["--out", {out!r}])
print(json.dumps({{"rc": rc, "calls": calls}}))
"""


def test_the_parent_never_asks_cuda(tmp_path: Path) -> None:
    """The GPU run's parent process forks every step: a cudaGetDeviceCount (cuInit) in it,
    e.g. torch.cuda.is_available(), would leave CUDA unusable in every child. Here (no GPU)
    the run stops at the availability probe, which must have run in a child."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _SPY.format(repo=str(REPO), out=str(tmp_path))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"rc": 2, "calls": []}, res
    assert "no CUDA device" in proc.stderr
