"""CUDA readiness without a GPU: AOT-compile every Triton kernel x every declared launch for sm_80 and sm_90a.

    .venv/bin/python -m tools.aot_cuda_check [--arch 80 --arch 90] [--json out.json] [--markdown out.md]
                                                 [--subset] [modules ...]

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
Exit status: 0 all compiled, 1 a compile failed, 2 not runnable here (no triton / no CUDA backend).
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

from tools.ascend_check import collect, kernel_modules

DEFAULT_ARCHS = (80, 90)


@dataclass
class Compiled:
    module: str
    kernel: str
    constexprs: dict[str, Any]
    arch: int
    status: str  # "ok" | "failed"
    target: str = ""  # the PTX .target (sm_80, sm_90a)
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    smem_static: int | None = None  # ptxas: static shared memory bytes
    smem_dynamic: int | None = None  # Triton: dynamic shared memory the launch requests
    num_warps: int | None = None
    seconds: float = 0.0
    message: str = ""
    pointer_dtypes: list[str] = field(default_factory=list)


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
    except Exception as exc:  # one failure must not hide the others
        res.status, res.message = "failed", f"{type(exc).__name__}: {str(exc)[-2000:]}"
    res.seconds = round(time.perf_counter() - t0, 2)
    return res


def specs_to_compile(modules: list[str] | None, subset: bool) -> tuple[list[Any], list[str]]:
    """(specialisations, declaration failures) from the kernel modules' LOWERING declarations."""
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


def _short(constexprs: dict[str, Any]) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in constexprs.items())


def markdown(results: list[Compiled]) -> str:
    lines = ["| kernel | specialisation (constexprs) | pointer dtypes | target | regs | spill st/ld (B) | "
             "smem static / dynamic (B) | warps | s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
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
    p.add_argument("--subset", action="store_true", help="one specialisation per kernel")
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
    results, failures = run(archs, a.modules, a.subset)
    table = markdown(results)
    print(table)
    failed = [r for r in results if r.status != "ok"]
    kernels = {(r.module, r.kernel) for r in results}
    print(f"\nAOT CUDA compile: {len(kernels)} kernels, {len(results) // max(len(archs), 1)} specialisations x "
          f"{len(archs)} archs ({', '.join(sorted({r.target for r in results if r.target}))}), {len(failed)} failed, "
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
