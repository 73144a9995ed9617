"""Shared by the torchair GE tests: the check's environment and one full check run per
session (its op and model graphs are compiled once; test_torchair_ge (W8A8 linears included) and
the value assertions read the same JSON)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[2]
SETUP = "bash tools/bootstrap.sh --with-ascend"


@pytest.fixture(scope="session")
def torchair_python() -> str:
    python = Path(os.environ.get("CP_COMPILE_TORCHAIR_PYTHON", REPO / ".venv-torchair" / "bin" / "python"))
    if not python.exists():
        pytest.fail(f"no torchair environment at {python}: run `{SETUP}` (the README's test command does), "
                    "or point CP_COMPILE_TORCHAIR_PYTHON at a python with torch-npu==2.13.0, protobuf, packaging "
                    "and cp_compile installed")
    return str(python)


def run_check(python: str, out: Path, *args: str, env: dict | None = None) -> tuple[int, dict, str]:
    extra = env or {}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch would otherwise import torch_npu (needs CANN)
    env.update(extra)
    proc = subprocess.run([python, "-m", "tools.ge_check", "--json", str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=2400)
    data = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, data, proc.stdout + proc.stderr[-4000:]


@pytest.fixture(scope="session")
def check(torchair_python: str, tmp_path_factory) -> tuple[int, dict, str]:
    # CP_COMPILE_GE_JSON keeps the run's JSON (the tables of docs/torchair.md come from it).
    out = os.environ.get("CP_COMPILE_GE_JSON") or tmp_path_factory.mktemp("ge") / "ge.json"
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return run_check(torchair_python, Path(out))
    # Under pytest-xdist every worker has its own session: the first to ask runs the
    # check, under a lock in the run's shared temp folder; the others read its result.
    shared = tmp_path_factory.getbasetemp().parent
    with FileLock(str(shared / "ge_check.lock")):
        cached = shared / "ge_check_result.json"
        if cached.exists():
            rc, data, output = json.loads(cached.read_text())
            return rc, data, output
        result = run_check(torchair_python, Path(out))
        cached.write_text(json.dumps(result))
        return result
