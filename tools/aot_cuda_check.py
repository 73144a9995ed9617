"""CUDA readiness without a GPU: AOT-compile every Triton kernel x every declared launch for sm_80 and sm_90a.

    .venv/bin/python -m tools.aot_cuda_check [--arch 80 --arch 90] [--json out.json] [--markdown out.md]
                                                 [--subset] [modules ...]
    .venv/bin/python -m tools.aot_cuda_check --production [--subset] [--kernel NAME ...]

The launches are the ones the Triton-Ascend lowering check compiles: each kernel
module's `LOWERING.examples` run with launches captured (`ascend_check.collect`:
the launchers' own argument types and constexprs, every @triton.jit kernel of the
module covered). Each distinct specialisation goes through upstream Triton's CUDA
backend, `triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`:
TTIR, TTGIR, LLVM IR, PTX, then a cubin from the ptxas Triton ships (no driver, no
device). GPUTarget("cuda", 90, 32) is sm_90a in Triton 3.x (read back from the PTX
`.target` line). ptxas -v on the same PTX gives registers, spill bytes and shared
memory; Triton's metadata gives its dynamic shared memory and warps.

`--subset` compiles one specialisation per kernel (the one with the smallest
constexprs), what the default test suite runs; the full set is under `slow`.

`--production` (issue 36) compiles instead the tiles the launchers pick at the
production shapes (`tools/production_tiles.py`: GQA / MLA decode and prefill, sparse
MLA, the indexer, the DCP merges, batch 1 / 8 / 64, 8k-128k, bf16), specialised as
Triton's JIT specialises the launch (`jit_specialisation`), and reports blocks per SM
besides registers, spills and shared memory; a spill at a production tile fails unless
`production_tiles.ALLOWED_SPILLS` names it with its reason. An fp8e4nv specialisation (an
fp8_e4m3 KV cache) below sm_89 is "not on arch" when the compiler refuses the type there
(`mark_not_on_arch`), in both modes. `--production --subset`:
the GQA and MLA decode tiles at batch 8, 32k (the default test); the table of
docs/kernels_aot.md is the full run:

    .venv/bin/python -m tools.aot_cuda_check --production --markdown docs/kernels_aot.md

Exit status: 0 all compiled (and, with --production, no unaccepted spill), 1 otherwise,
2 not runnable here (no triton / no CUDA backend).
Runs in `.venv` (upstream triton), never with TRITON_INTERPRET set.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_ARCHS = (80, 90)


@dataclass
class Compiled:
    module: str
    kernel: str
    constexprs: dict[str, Any]
    arch: int
    status: str  # "ok" | "failed" | "not on arch" (fp8 below sm_89: `mark_not_on_arch`)
    target: str = ""  # the PTX .target (sm_80, sm_90a)
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    smem_static: int | None = None  # ptxas: static shared memory bytes
    smem_dynamic: int | None = None  # Triton: dynamic shared memory the launch requests
    num_warps: int | None = None
    blocks_per_sm: int | None = None  # resident blocks an SM holds (registers, shared memory, warps)
    seconds: float = 0.0
    message: str = ""
    pointer_dtypes: list[str] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)  # --production: the shapes that launch this tile
    allowed: str = ""  # --production: why a spill here is accepted (tools/production_tiles.ALLOWED_SPILLS)


_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def ptxas_stats(ptx: str, arch: int) -> dict[str, int]:
    """Registers / spills / static smem from `ptxas -v` on the PTX (Triton's own ptxas)."""
    from triton.backends.nvidia.compiler import get_ptxas

    target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([get_ptxas(arch).path, f"-arch={target}", "-v", str(src), "-o", str(Path(d) / "k.o")],
                              capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"ptxas failed: {log[-1000:]}")
    used, spill, smem = _PTXAS_USED.search(log), _PTXAS_SPILL.search(log), _PTXAS_SMEM.search(log)
    return {"registers": int(used.group(1)) if used else 0,
            "spill_stores": int(spill.group(1)) if spill else 0, "spill_loads": int(spill.group(2)) if spill else 0,
            "smem_static": int(smem.group(1)) if smem else 0}


def jit_specialisation(spec: Any, values: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any], dict]:
    """(signature, constexprs, attrs) as Triton's CUDA JIT would specialise a launch with
    these argument values: an int equal to 1 becomes the constant 1, an int divisible by
    16 and every tensor pointer (torch's allocations are 256-byte aligned; the launchers'
    views start at their storage) carry `tt.divisibility` 16. What the JIT compiles on
    the GPU, e.g. a unit column stride known to be 1, so the loads vectorise; the
    declared-launch compile types every int as a runtime i32 and misses that."""
    signature = {**spec.signature, **{k: "constexpr" for k in spec.constexprs}}
    constexprs, attrs = dict(spec.constexprs), {}
    names = list(spec.kernel.arg_names)
    for name, ty in spec.signature.items():
        value = values.get(name)
        if ty.startswith("*"):
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
        elif ty in ("i32", "i64") and isinstance(value, int) and not isinstance(value, bool):
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
            elif value % 16 == 0:
                attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def compile_spec(spec: Any, arch: int, values: dict[str, Any] | None = None) -> Compiled:
    """Compile one specialisation for sm_`arch`. values: the launch's argument values,
    to specialise them as the JIT does (`jit_specialisation`); None: every int a runtime
    i32, no alignment (the declared-launch check)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    res = Compiled(spec.kernel.fn.__module__, spec.name, dict(spec.constexprs), arch, "ok",
                   pointer_dtypes=sorted({t[1:] for t in spec.signature.values() if t.startswith("*")}))
    t0 = time.perf_counter()
    try:
        if values is None:
            signature, constexprs, attrs = {**spec.signature, **{k: "constexpr" for k in spec.constexprs}}, \
                dict(spec.constexprs), {}
        else:
            signature, constexprs, attrs = jit_specialisation(spec, values)
        compiled = triton.compile(ASTSource(spec.kernel, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", arch, 32), options=dict(spec.options))
        ptx = compiled.asm["ptx"]
        if not compiled.asm.get("cubin"):
            raise RuntimeError("no cubin produced")
        res.target = re.search(r"^\.target\s+(\S+)", ptx, re.M).group(1)
        for k, v in ptxas_stats(ptx, arch).items():
            setattr(res, k, v)
        res.smem_dynamic = int(compiled.metadata.shared)
        res.num_warps = int(compiled.metadata.num_warps)
        res.blocks_per_sm = blocks_per_sm(arch, res.registers, res.smem_static + res.smem_dynamic, res.num_warps)
    except Exception as exc:  # one failure must not hide the others
        res.status, res.message = "failed", f"{type(exc).__name__}: {str(exc)[-2000:]}"
    res.seconds = round(time.perf_counter() - t0, 2)
    return res


def specs_to_compile(modules: list[str] | None, subset: bool) -> tuple[list[Any], list[str]]:
    """(specialisations, declaration failures) from the kernel modules' LOWERING declarations."""
    from tools.ascend_check import collect, kernel_modules  # imports triton: not at module import

    specs, failures = [], []
    for module in kernel_modules(modules or None):
        found, bad = collect(module)
        failures += [f"{r.module}.{r.kernel}: {r.message}" for r in bad]
        if subset:  # one per kernel: the smallest tiles (the quickest compile that still runs every stage)
            by_kernel: dict[str, Any] = {}
            for s in found:
                size = sum(v for v in s.constexprs.values() if isinstance(v, int) and not isinstance(v, bool))
                best = by_kernel.get(s.name)
                if best is None or size < best[0]:
                    by_kernel[s.name] = (size, s)
            found = [s for _, s in by_kernel.values()]
        specs += found
    return specs, failures


# Per-SM limits (CUDA occupancy rules): 64K 32-bit registers allocated per warp in units of 256,
# shared memory per SM and 1 KB of it reserved per block, 64 warps, 32 blocks.
_SM_SMEM = {80: 167936, 90: 233472}
_SMEM_RESERVED = 1024


def blocks_per_sm(arch: int, registers: int, smem: int, warps: int) -> int:
    """Blocks of this kernel one SM holds at once (0: it cannot launch)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    by_regs = 65536 // (per_warp * warps)
    by_smem = _SM_SMEM.get(arch, _SM_SMEM[80]) // (smem + _SMEM_RESERVED)
    return max(0, min(by_regs, by_smem, 64 // warps, 32))


def production_units(subset: bool = False, kernels: tuple[str, ...] = ()) -> list[tuple[Any, dict[str, Any], list[str]]]:
    """(specialisation, argument values, labels) of each distinct production tile.

    One compile per (kernel, constexprs, compile options, arguments equal to 1, pointer dtypes): the
    JIT's specialisations that change the code; launches that differ only in which
    counts are divisible by 16 share the compile of the first shape listed.
    subset: the representative tiles the default test compiles (the GQA decode tile of 8
    q heads per KV head and the MLA decode tile of 128 heads, at batch 8, 32k).
    kernels: only these kernels' tiles (`--kernel`; all when empty)."""
    from tools.ascend_check import _Spec, launch_options, specialise
    from tools.production_tiles import production_launches

    units: dict[tuple, tuple[Any, dict[str, Any], list[str]]] = {}
    for pl in production_launches():
        if kernels and pl.kernel_name not in kernels:
            continue
        if subset and not (pl.kernel_name == "_paged_attention_lse_kernel" and "batch 8, 32k" in pl.label
                           and ("GQA decode 8 " in pl.label or "MLA decode 128 " in pl.label)):
            continue
        signature, constexprs = specialise(pl.launch)
        options = launch_options(pl.launch)
        ones = tuple(sorted(n for n, t in signature.items() if t in ("i32", "i64") and pl.values.get(n) == 1))
        # The pointer dtypes too: an int8 and an fp8 cache launch the same constexprs (different code).
        pointers = tuple(t for t in signature.values() if t.startswith("*"))
        key = (pl.kernel_name, tuple(constexprs.items()), tuple(options.items()), ones, pointers)
        if key not in units:
            units[key] = (_Spec(pl.launch.kernel, signature, constexprs, None, options), pl.values, [])
        units[key][2].append(pl.label)
    return list(units.values())


def run_production(archs: tuple[int, ...], subset: bool = False, progress: bool = True,
                   kernels: tuple[str, ...] = ()) -> list[Compiled]:
    """Compile every production tile for each arch, as the JIT specialises it; each result
    names its shapes and, where a spill is accepted, why (`production_tiles.allowed_spill`)."""
    from tools.production_tiles import allowed_spill

    results = []
    units = production_units(subset, kernels)
    for i, (spec, values, labels) in enumerate(units):
        for arch in archs:
            r = compile_spec(spec, arch, values)
            r.labels = labels
            r.constexprs = {**r.constexprs, **spec.options}
            if r.status == "ok" and (r.spill_stores or r.spill_loads):
                r.allowed = next((a for a in (allowed_spill(r.kernel, lb, arch) for lb in labels) if a), "")
            mark_not_on_arch(r)
            if progress:
                print(f"[{i + 1}/{len(units)} sm_{arch}] {spec.name} {_short(r.constexprs)}: {r.status} "
                      f"regs={r.registers} spills={r.spill_stores}/{r.spill_loads} smem={r.smem_dynamic} "
                      f"blocks/SM={r.blocks_per_sm} {r.seconds}s", file=sys.stderr, flush=True)
            results.append(r)
    return results


# Triton's fp8e4nv (torch.float8_e4m3fn) exists from sm_89 on: the kernels over an fp8_e4m3 KV
# cache (the quantising cache write, the quantised prefill) are not built for sm_80; an fp8 cache
# on CUDA needs sm_89 / sm_90a, int8 runs on sm_80.
FP8E4NV_MIN_ARCH = 89
FP8_NOT_ON_ARCH = ("fp8e4nv needs sm_89+: Triton has no float8_e4m3fn below it ('type fp8e4nv not supported in "
                   "this architecture'); an fp8_e4m3 KV cache on CUDA needs sm_89 / sm_90a, int8 runs on sm_80")


def mark_not_on_arch(r: Compiled) -> None:
    """An fp8e4nv specialisation compiled for an arch below sm_89 whose compile failed saying
    so becomes "not on arch" with the reason; any other failure stays a failure."""
    if (r.status == "failed" and r.arch < FP8E4NV_MIN_ARCH and "fp8e4nv" in r.pointer_dtypes
            and "not supported in this architecture" in r.message):
        r.status, r.allowed = "not on arch", FP8_NOT_ON_ARCH


def production_problems(results: list[Compiled]) -> list[str]:
    """Why the production check fails: a compile failure, a spill not in the allow-list, a
    tile no SM can hold."""
    bad = []
    for r in results:
        where = f"{r.kernel} {_short(r.constexprs)} on {r.target or f'sm_{r.arch}'} ({r.labels[0] if r.labels else ''})"
        if r.status == "not on arch":
            continue
        if r.status != "ok":
            bad.append(f"{where}: compile failed: {r.message.splitlines()[-1] if r.message else ''}")
        elif (r.spill_stores or r.spill_loads) and not r.allowed:
            bad.append(f"{where}: spills {r.spill_stores}/{r.spill_loads} B; pick a tile that does not (launcher "
                       "tile choice, num_warps) or name it with its reason in tools/production_tiles.ALLOWED_SPILLS")
        elif r.blocks_per_sm == 0:
            bad.append(f"{where}: no SM holds one block ({r.registers} registers x {r.num_warps} warps, "
                       f"{r.smem_static + r.smem_dynamic} B shared memory)")
    return bad


def production_markdown(results: list[Compiled]) -> str:
    lines = ["| kernel | tile (constexprs, num_warps) | shapes (first of n) | target | regs | spill st/ld (B) | "
             "smem static + dynamic (B) | warps | blocks/SM | spill accepted because |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        shapes = f"{r.labels[0]} (1 of {len(r.labels)})" if r.labels else ""
        if r.status == "not on arch":
            lines.append(f"| {r.kernel} | {_short(r.constexprs)} | {shapes} | sm_{r.arch} | not built | | | | | "
                         f"{r.allowed.split(':')[0]} |")
            continue
        if r.status != "ok":
            lines.append(f"| {r.kernel} | {_short(r.constexprs)} | {shapes} | sm_{r.arch} | FAILED | | | | | |")
            continue
        lines.append(f"| {r.kernel} | {_short(r.constexprs)} | {shapes} | {r.target} | {r.registers} | "
                     f"{r.spill_stores}/{r.spill_loads} | {r.smem_static} + {r.smem_dynamic} | {r.num_warps} | "
                     f"{r.blocks_per_sm} | {r.allowed.split(':')[0] if r.allowed else ''} |")
    return "\n".join(lines)


def _short(constexprs: dict[str, Any]) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in constexprs.items())


def markdown(results: list[Compiled]) -> str:
    lines = ["| kernel | specialisation (constexprs) | pointer dtypes | target | regs | spill st/ld (B) | "
             "smem static / dynamic (B) | warps | s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.status == "not on arch":
            lines.append(f"| {r.kernel} | {_short(r.constexprs)} | {','.join(r.pointer_dtypes)} | sm_{r.arch} | "
                         f"not built: {r.allowed.split(':')[0]} | | | | {r.seconds} |")
            continue
        if r.status != "ok":
            lines.append(f"| {r.kernel} | {_short(r.constexprs)} | {','.join(r.pointer_dtypes)} | sm_{r.arch} | "
                         f"FAILED: {r.message.splitlines()[0][:80] if r.message else ''} | | | | {r.seconds} |")
            continue
        lines.append(f"| {r.kernel} | {_short(r.constexprs)} | {','.join(r.pointer_dtypes)} | {r.target} | "
                     f"{r.registers} | {r.spill_stores}/{r.spill_loads} | {r.smem_static} / {r.smem_dynamic} | "
                     f"{r.num_warps} | {r.seconds} |")
    return "\n".join(lines)


def run(archs: tuple[int, ...], modules: list[str] | None = None, subset: bool = False,
        progress: bool = True) -> tuple[list[Compiled], list[str]]:
    specs, failures = specs_to_compile(modules, subset)
    results = []
    for i, spec in enumerate(specs):
        for arch in archs:
            r = compile_spec(spec, arch)
            mark_not_on_arch(r)
            if progress:
                print(f"[{i + 1}/{len(specs)} sm_{arch}] {spec.name} {_short(spec.constexprs)}: {r.status} "
                      f"regs={r.registers} spills={r.spill_stores}/{r.spill_loads} smem={r.smem_dynamic} "
                      f"{r.seconds}s", file=sys.stderr, flush=True)
            results.append(r)
    return results, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("modules", nargs="*", help="kernel module names (default: every ops/<family>/triton_*.py)")
    p.add_argument("--arch", type=int, action="append", help="CUDA compute capability (default: 80 and 90)")
    p.add_argument("--subset", action="store_true", help="one specialisation per kernel (with --production: "
                   "the representative decode tiles)")
    p.add_argument("--production", action="store_true", help="the tiles the launchers pick at the production "
                   "shapes (tools/production_tiles.py), specialised as the JIT does; a spill not in the allow-list fails")
    p.add_argument("--kernel", action="append", help="with --production: only this kernel's tiles (repeatable)")
    p.add_argument("--json", type=Path)
    p.add_argument("--markdown", type=Path)
    a = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter compiles nothing", file=sys.stderr)
        return 2
    try:
        from triton.backends.nvidia import compiler  # noqa: F401
    except ImportError as exc:
        print(f"upstream triton with its CUDA backend is not importable ({exc}); run in .venv", file=sys.stderr)
        return 2
    archs = tuple(a.arch or DEFAULT_ARCHS)
    if a.production:
        results = run_production(archs, a.subset, kernels=tuple(a.kernel or ()))
        table = production_markdown(results)
        print(table)
        problems = production_problems(results)
        print(f"\nAOT CUDA compile at production tiles: {len(results) // max(len(archs), 1)} tiles x {len(archs)} archs, "
              f"{sum(1 for r in results if r.spill_stores or r.spill_loads)} spilling "
              f"({sum(1 for r in results if r.allowed and r.status == 'ok')} accepted), "
              f"{sum(r.status == 'not on arch' for r in results)} not on their arch, {len(problems)} problems, "
              f"{sum(r.seconds for r in results):.0f} s")
        for line in problems:
            print(f"problem: {line}")
        if a.json:
            a.json.write_text(json.dumps({"archs": archs, "production": True, "results": [asdict(r) for r in results],
                                          "problems": problems}, indent=1, default=str))
        if a.markdown:
            a.markdown.write_text(table + "\n")
        return 1 if problems else 0
    results, failures = run(archs, a.modules, a.subset)
    table = markdown(results)
    print(table)
    failed = [r for r in results if r.status not in ("ok", "not on arch")]
    kernels = {(r.module, r.kernel) for r in results}
    print(f"\nAOT CUDA compile: {len(kernels)} kernels, {len(results) // max(len(archs), 1)} specialisations x "
          f"{len(archs)} archs ({', '.join(sorted({r.target for r in results if r.target}))}), {len(failed)} failed, "
          f"{sum(r.status == 'not on arch' for r in results)} not on their arch (fp8 below sm_89), "
          f"{len(failures)} declaration failures, {sum(r.seconds for r in results):.0f} s")
    for f in failures:
        print(f"declaration: {f}")
    if a.json:
        a.json.write_text(json.dumps({"archs": archs, "results": [asdict(r) for r in results],
                                      "declaration_failures": failures}, indent=1, default=str))
    if a.markdown:
        a.markdown.write_text(table + "\n")
    return 1 if failed or failures else 0


if __name__ == "__main__":
    sys.exit(main())
