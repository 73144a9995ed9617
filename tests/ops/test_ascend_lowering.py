"""Triton-Ascend readiness without an NPU (docs/architecture.md §8, tools/ascend_check.py).

The check runs in its own environment (.venv-ascend: CPU torch + triton-ascend, which
owns the `triton` module name) as a subprocess: every @triton.jit kernel of
the op families (ops/<family>/triton_*.py), for every launch its module declares, lowers TTIR -> linalg
through triton-ascend's NPU adapter and keeps the §8 rules. A fixture module of
unsupported constructs shows the check can fail. The launch-side rules (grid budget,
int32 guard, capture) are checked here in the main environment too.

This file imports no triton at module level: test_kernels.py must be the first to
import it, with TRITON_INTERPRET set.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
# the Triton kernel modules of the op families (tools/ascend_check.py finds them by import)
KERNELS = sorted((REPO / "ops").glob("*/triton_*.py"))
FIXTURE = Path(__file__).parent / "ascend_fixtures" / "unsupported_kernels.py"
SETUP = "bash tools/bootstrap.sh --with-ascend"


@pytest.fixture(scope="module")
def ascend_python() -> str:
    python = Path(os.environ.get("CP_COMPILE_ASCEND_PYTHON", REPO / ".venv-ascend" / "bin" / "python"))
    if not python.exists():
        pytest.fail(f"no triton-ascend environment at {python}: run `{SETUP}` (the README's test command does), "
                    "or point CP_COMPILE_ASCEND_PYTHON at a python with triton-ascend and cp_compile installed")
    return str(python)


def run_check(python: str, out: Path, *modules: str) -> tuple[int, dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([python, "-m", "tools.ascend_check", "--json", str(out), *modules],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    data = json.loads(out.read_text()) if out.exists() else {}
    return proc.returncode, data, proc.stdout + proc.stderr[-4000:]


def jitted_in_source() -> set[str]:
    """Launched @triton.jit kernels in ops/<family>/triton_*.py, read from the source text: an
    independent count, so the check's import-based discovery cannot miss one. Helpers
    a module lists in `LOWERING.helpers` are inlined into their callers (lowered with
    them), never launched, so they are not counted."""
    names, helpers = set(), set()
    for path in KERNELS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
                names.add(node.name)
            if isinstance(node, ast.keyword) and node.arg == "helpers":
                helpers |= set(ast.literal_eval(node.value))
    return names - helpers


def test_every_kernel_lowers_for_ascend(ascend_python: str, tmp_path: Path, summary_note) -> None:
    rc, data, output = run_check(ascend_python, tmp_path / "kernels.json")
    failed = [f"{r['kernel']} {r['constexprs']} at {r['stage']}:\n{r['message']}"
              for r in data.get("results", []) if r["status"] not in ("ok", "absent")]
    assert rc == 0 and not failed, output + "\n\n" + "\n\n".join(failed)
    results = data["results"]
    assert {r["kernel"] for r in results} == jitted_in_source()
    summary = data["summary"]
    assert summary["kernels"] == len(jitted_in_source()) >= 4
    assert summary["constexpr_sets"] >= summary["kernels"]
    # Not lowered only where declared (LOWERING.not_on_ascend: the quantised cache write, prefill and MLA tail, whose
    # ops declare npu=Absent), each with its reason; everything else lowered.
    absent = {r["kernel"] for r in results if r["status"] == "absent"}
    assert absent == {"_cache_write_quant_kernel", "_paged_prefill_quant_kernel", "_mla_tail_quant_kernel"}, absent
    for r in results:
        if r["status"] == "absent":
            assert "Absent" in r["message"] and r["examples"], r
        else:
            assert r["linalg_lines"] > 0 and r["examples"], r
    # The cube path and MLA's two products (latent 512 + rope 64, no pad to 1024) are among what was lowered.
    paged = [r["constexprs"] for r in results if r["kernel"] == "_paged_attention_lse_kernel"]
    assert any(c["USE_DOT"] for c in paged) and any(c["D_PAD"] == 512 and c["DR_PAD"] == 64 for c in paged)
    summary_note(f"Triton-Ascend lowering check ({data['stage']}, {data['arch']}): {summary['kernels']} kernels, "
                 f"{summary['constexpr_sets']} constexpr sets, {summary['specialisations']} specialisations, "
                 f"all lowered and within docs/architecture.md §8 rules, {summary['seconds']:.1f} s of compiling "
                 "(.venv-ascend/bin/python -m tools.ascend_check prints the table)")


def test_unsupported_constructs_fail_the_check(ascend_python: str, tmp_path: Path) -> None:
    # EXPECTED is read from the source: importing the fixture here would import triton.
    expected = ast.literal_eval(re.search(r"EXPECTED[^=]*= (\{.*?\n\})", FIXTURE.read_text(), re.DOTALL).group(1))
    assert len(expected) >= 10
    rc, data, output = run_check(ascend_python, tmp_path / "fixtures.json", str(FIXTURE))
    assert rc == 1, output
    by_kernel = {r["kernel"]: r for r in data["results"]}
    assert set(by_kernel) == set(expected), output
    for kernel, expect in expected.items():
        r = by_kernel[kernel]
        if expect is None:
            assert r["status"] == "ok", r
            continue
        stage, text = expect
        assert r["status"] == "failed" and r["stage"] == stage and text in r["message"], (kernel, r)
    # The adapter's own diagnostic reaches the report.
    assert "error:" in by_kernel["_pointer_chase_kernel"]["message"]
    assert "triton-adapter-opt" in by_kernel["_pointer_chase_kernel"]["message"]


# ----------------------------------------------------------------------------- launch rules (main environment)


def test_grid_is_bounded_by_the_core_budget() -> None:
    from cp_compile.ops.core.triton_common import CPU_MAX_PROGRAMS, grid_size, max_programs

    cpu = torch.device("cpu")
    assert max_programs(cpu) == max_programs(cpu, uses_cube=True) == CPU_MAX_PROGRAMS
    assert grid_size(3, cpu) == 3
    assert grid_size(10_000, cpu) == CPU_MAX_PROGRAMS
    assert grid_size(10_000, cpu, num_programs=5) == 5
    assert grid_size(0, cpu) == 1
    with pytest.raises(ValueError, match="num_programs must be >= 1"):
        grid_size(4, cpu, num_programs=0)


@pytest.mark.accelerator
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (SM count)")
def test_cuda_grid_is_the_sm_count() -> None:
    from cp_compile.ops.core.triton_common import max_programs

    device = torch.device("cuda", 0)
    assert max_programs(device) == torch.cuda.get_device_properties(0).multi_processor_count


def test_launcher_refuses_offsets_past_int32() -> None:
    from cp_compile.ops.paged.triton_decode import paged_attention_with_lse_triton

    q = torch.empty(2, 4, 128, device="meta")
    # A cache view whose page stride spans 2**31 elements (e.g. all layers in one tensor).
    cache = torch.empty(0, device="meta").as_strided((2, 16, 1, 128), (2**31, 128, 128, 1))
    bt = torch.zeros(1, 2, dtype=torch.int32, device="meta")
    with pytest.raises(ValueError, match="index in int32"):
        paged_attention_with_lse_triton(q, cache, cache, bt, bt[0], bt[0], 0.1)


def test_capture_records_the_launchers_constexprs() -> None:
    from cp_compile.ops.paged.triton_decode import paged_attention_with_lse_triton
    from cp_compile.ops.core.triton_common import CPU_MAX_PROGRAMS, capture_launches

    q = torch.empty(3, 8, 128, dtype=torch.bfloat16)
    cache = torch.empty(2, 16, 1, 128, dtype=torch.bfloat16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    args = (q, cache, cache, bt, torch.tensor([0, 3]), torch.ones(3, dtype=torch.int32), 0.1)
    with capture_launches() as launches:
        out, lse = paged_attention_with_lse_triton(*args, num_splits=1)  # the NPU's launch
    assert out.shape == (3, 8, 128) and lse.dtype == torch.float32
    (launch,) = launches
    assert launch.kernel.fn.__name__ == "_paged_attention_lse_kernel"
    assert len(launch.grid) == 1 and launch.grid[0] <= CPU_MAX_PROGRAMS
    assert launch.kwargs == dict(BLOCK_H=8, BLOCK_N=8, D_PAD=128, DV_PAD=128, DR_PAD=0, USE_DOT=False, QUANT=False)
    # Split-KV (the default off the NPU): the split kernel, then the split merge.
    with capture_launches() as launches:
        paged_attention_with_lse_triton(*args, num_splits=2)
    assert [lc.kernel.fn.__name__ for lc in launches] == ["_paged_attention_lse_kernel", "_split_merge_kernel"]
