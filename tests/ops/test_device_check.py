"""CUDA readiness without a GPU (issue 22): the AOT compile check and the device script's dry run.

- `tools/device_check.py --dry-run` (what CI runs): every step printed, every Triton
  kernel AOT-compiled for sm_80 and sm_90a (one specialisation each,
  `aot_cuda_check.py --subset`), registers / spills / smem recorded;
- the AOT check fails on a kernel that does not compile for CUDA (a fixture);
- under `slow`: every kernel x every declared launch specialisation x both archs
  (the table in docs/kernels.md);
- `aot_cuda_check.py --production`: the tiles the launchers pick at the production shapes,
  specialised as the JIT does, spill-free unless named with a reason (the decode tiles by
  default, every production tile under `slow`; docs/kernels_aot.md).

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


def _production(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "aot_production.json"
    proc = subprocess.run([sys.executable, "-m", "tools.aot_cuda_check", "--production", *args, "--json", str(out)],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=7200)
    return proc, (json.loads(out.read_text()) if out.exists() else {})


def test_aot_production_decode_tiles_do_not_spill(tmp_path: Path) -> None:
    """The decode attention tiles the launcher picks at batch 8, 32k for GQA (8 q heads per
    KV head, D 128: 16 x 64 keys) and MLA (128 heads of 512 + 64: 32 heads x 32 keys at 8
    warps), specialised as the JIT does (unit strides constant, 16-divisible ints
    marked), compile for sm_90a (the issue's target; sm_80 is in the slow run) with no
    spill and at least one block per SM."""
    proc, data = _production(tmp_path, "--subset", "--arch", "90")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = data["results"]
    assert {(r["labels"][0].split(",")[0], r["target"]) for r in rows} == {
        ("GQA decode 8 q heads per KV head", "sm_90a"), ("MLA decode 128 heads 512+64", "sm_90a")}
    for r in rows:
        assert r["status"] == "ok" and r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["blocks_per_sm"] >= 1 and r["registers"] <= 255
    mla = [r["constexprs"] for r in rows if r["labels"][0].startswith("MLA")]
    assert all((c["BLOCK_H"], c["BLOCK_N"], c["num_warps"]) == (32, 32, 8) for c in mla)


def test_aot_production_spill_fails_unless_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The verdict of the production check: a spill fails unless the allow-list names the
    tile (its reason then shows in the table), a tile no SM can hold fails, a clean one
    passes; blocks per SM follow registers, shared memory and warps."""
    from tools.aot_cuda_check import Compiled, blocks_per_sm, production_problems
    from tools.production_tiles import allowed_spill

    def row(kernel: str, label: str, spill: int, smem: int = 40000, regs: int = 200) -> Compiled:
        r = Compiled("m", kernel, {"BLOCK_H": 64}, 90, "ok", target="sm_90a", registers=regs, spill_stores=spill,
                     spill_loads=spill, smem_static=0, smem_dynamic=smem, num_warps=8, labels=[label])
        r.blocks_per_sm = blocks_per_sm(90, regs, smem, 8)
        r.allowed = (allowed_spill(kernel, label, 90) or "") if spill else ""
        return r

    decode = row("_paged_attention_lse_kernel", "MLA decode 128 heads 512+64, batch 8, 32k", spill=60)
    problems = production_problems([decode])
    assert len(problems) == 1 and "spills 60/60 B" in problems[0] and "ALLOWED_SPILLS" in problems[0]
    assert production_problems([row("_paged_attention_lse_kernel", "MLA decode", spill=0)]) == []
    # The allow-list is empty (no production tile spills): the sparse MLA tile's old 40 B
    # now fails; an entry naming it would accept it, its reason shown.
    sparse = row("_sparse_mla_kernel", "sparse MLA top-2048 16 heads, batch 8", spill=40)
    assert not sparse.allowed and "spills 40/40 B" in production_problems([sparse])[0]
    monkeypatch.setattr("tools.production_tiles.ALLOWED_SPILLS", {("_sparse_mla_kernel", "sparse MLA", 90): "why"})
    sparse = row("_sparse_mla_kernel", "sparse MLA top-2048 16 heads, batch 8", spill=40)
    assert sparse.allowed == "why" and production_problems([sparse]) == []
    assert allowed_spill("_sparse_mla_kernel", "sparse MLA top-2048 16 heads, batch 8", 80) is None  # arch-bound
    too_big = row("_paged_attention_lse_kernel", "GQA decode", spill=0, smem=240000)
    assert too_big.blocks_per_sm == 0 and "no SM holds one block" in production_problems([too_big])[0]
    assert blocks_per_sm(90, 190, 76032, 8) == 1 and blocks_per_sm(90, 154, 39168, 4) == 3
    assert blocks_per_sm(80, 32, 0, 4) == 16  # warps bound it: 64 warps an SM


def test_aot_fp8_below_sm89_is_not_on_arch_only_by_the_compilers_word() -> None:
    """An fp8e4nv specialisation on sm_80 (an fp8_e4m3 KV cache's kernels) is "not on arch"
    only when its compile failed with Triton's "not supported in this architecture"; any
    other failure, the same failure on sm_90 or without an fp8 pointer, stays a problem."""
    from tools.aot_cuda_check import Compiled, mark_not_on_arch, production_problems

    said = 'ValueError("type fp8e4nv not supported in this architecture. The supported fp8 dtypes are ...")'

    def failed(arch: int, message: str, pointers: tuple[str, ...] = ("bf16", "fp32", "fp8e4nv", "i32")) -> Compiled:
        r = Compiled("m", "_paged_prefill_quant_kernel", {}, arch, "failed", pointer_dtypes=list(pointers),
                     message=f"CompilationError: at 1:0:\n{message}", labels=["GQA prefill, fp8_e4m3 cache"])
        mark_not_on_arch(r)
        return r

    fp8_sm80 = failed(80, said)
    assert fp8_sm80.status == "not on arch" and "sm_89" in fp8_sm80.allowed and production_problems([fp8_sm80]) == []
    for r in (failed(80, "IndexError: out of resources"), failed(90, said),
              failed(80, said, ("bf16", "fp32", "i32", "i8"))):
        assert r.status == "failed" and len(production_problems([r])) == 1, r


@pytest.mark.slow
def test_aot_production_quantised_prefill_tiles(tmp_path: Path) -> None:
    """The quantised prefill tiles (int8 / fp8 GQA and MLA, 8k prompt) compile for sm_90a and
    sm_80 with no spill, fp8 on sm_80 excepted (no fp8e4nv there)."""
    proc, data = _production(tmp_path, "--kernel", "_paged_prefill_quant_kernel")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = data["results"]
    assert len(rows) == 8 and {r["kernel"] for r in rows} == {"_paged_prefill_quant_kernel"}
    for r in rows:
        if r["status"] == "not on arch":
            assert r["arch"] == 80 and "fp8_e4m3 cache" in r["labels"][0] and "fp8e4nv" in r["pointer_dtypes"], r
        else:
            assert r["status"] == "ok" and r["spill_stores"] == 0 and r["spill_loads"] == 0, r
    assert sum(r["status"] == "ok" for r in rows) == 6


@pytest.mark.slow
def test_aot_every_specialisation_both_archs(tmp_path: Path) -> None:
    out = tmp_path / "aot.json"
    proc = subprocess.run([sys.executable, "-m", "tools.aot_cuda_check", "--json", str(out)], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=7200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert {r["kernel"] for r in rows} == _jitted_kernels()
    assert {r["target"] for r in rows if r["status"] == "ok"} == {"sm_80", "sm_90a"}
    # fp8 KV-cache kernels are not built for sm_80 (no fp8e4nv), and only those
    assert all(r["arch"] == 80 and "fp8e4nv" in r["pointer_dtypes"] for r in rows if r["status"] != "ok")


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
    # MLA: 16 heads are one tile; 128 heads four 32-head blocks whose latent rows the model
    # reads from HBM once per split (the blocks are grid neighbours), never once per block.
    mla16 = rows[("MLA 16 heads, 512+64", 8, 32768, "split")]
    mla128 = rows[("MLA 128 heads, 512+64", 8, 32768, "split")]
    assert (mla16["block_h"], mla16["head_blocks"]) == (16, 1)
    assert (mla128["block_h"], mla128["head_blocks"]) == (32, 4) and mla128["grid"] >= 2 * decode_plan.SMS
    latent = 8 * 32768 * 576 * 2
    assert latent <= mla128["launches"][0]["bytes_read"] < 1.05 * latent  # + each item's q tile (4 %)


@pytest.mark.slow
def test_aot_production_every_tile_both_archs(tmp_path: Path) -> None:
    """Every production tile (tools/production_tiles.py) x sm_80 / sm_90a: compiled, and
    no spill outside the allow-list (the table of docs/kernels_aot.md)."""
    proc, data = _production(tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    kernels = {r["kernel"] for r in data["results"]}
    assert {"_paged_attention_lse_kernel", "_split_merge_kernel", "_paged_prefill_kernel", "_sparse_mla_kernel",
            "_index_scores_kernel", "_merge_partials_kernel", "_lse_rescale_kernel"} <= kernels
    assert data["problems"] == []
