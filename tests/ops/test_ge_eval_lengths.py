"""The GE evaluator refuses out-of-range lengths as a failed graph naming the op and the
value (tools/ge_eval, issue 35 item 8), instead of crashing in torch (a KV length of -1
reached `torch.arange(-1)`), and turns any other crash of an op function into a
failed graph that names the op.

The evaluator reads torchair's protobuf enums, so the cases (ge_eval_length_cases.py)
run in the torchair environment, all in one subprocess that prints each outcome as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def outcomes(torchair_python: str) -> dict[str, str]:
    proc = subprocess.run([torchair_python, "-m", "tests.ops.ge_eval_length_cases"], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_in_range_lengths_evaluate(outcomes: dict[str, str]) -> None:
    assert outcomes["fia 5"] == "ok" and outcomes["sfa 2"] == "ok", outcomes


@pytest.mark.parametrize("op,case", [("FusedInferAttentionScore", "fia"), ("SparseFlashAttention", "sfa")])
@pytest.mark.parametrize("kv_len,why", [(-1, "negative length -1 at batch 0"),
                                        (9, "length 9 at batch 0 is past the block table's 8 keys")])
def test_out_of_range_kv_length_fails_naming_op_and_value(outcomes: dict[str, str], op: str, case: str,
                                                          kv_len: int, why: str) -> None:
    got = outcomes[f"{case} {kv_len}"]
    assert got.startswith(f"GEEvalError: {op} '{op}_0': actual_seq_lengths_kv: ") and why in got, got


def test_an_op_function_crash_is_a_failed_graph_naming_the_op(outcomes: dict[str, str]) -> None:
    assert outcomes["crash"].startswith("GEEvalError: CpCheckCrash 'crash_0': the evaluator's CpCheckCrash "
                                        "raised RuntimeError"), outcomes["crash"]
