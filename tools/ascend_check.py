"""Triton-Ascend lowering check: every kernel, every launch, no NPU needed (docs/architecture.md §8).

For each Triton kernel module of the op families (`ops/<family>/triton_*.py`, found by
`cp_compile.ops.core.launcher.kernel_module_names`; or the modules named on the command
line) it
1. finds every `@triton.jit` kernel defined there (discovered, not listed);
2. runs the module's `LOWERING.examples` - calls to its launchers the way the project
   makes them - with launches captured instead of run, so the argument types and
   constexprs are the launcher's own; a kernel no example launches fails;
3. compiles each distinct (argument types, constexprs) specialisation through
   triton-ascend's NPU backend: `AscendBackend(GPUTarget("npu", arch, 0))`, TTIR,
   then `ttir_to_linalg(named_ops=True)` (the shipped `triton-adapter-opt`);
4. checks the docs/architecture.md §8 rules on the TTIR and the launch: a 1D persistent grid no
   larger than the core budget, int32 values (int64 only where the module says why),
   fp32 reductions and dot accumulators, no fp64, no atomics.

`--npubin` also runs the final `bishengir-compile` step (`triton.compile` for the NPU
target); that needs CANN and is for a real Ascend machine. Without it the check stops
at linalg, which is all this repository's CI can run.

triton-ascend owns the `triton` module name, so this runs in its own environment
(`.venv-ascend`, made by `tools/bootstrap.sh --with-ascend`):

    .venv-ascend/bin/python -m tools.ascend_check [--json out.json]

Exit status: 0 all lowered and kept the rules, 1 something failed, 2 not runnable here.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from cp_compile.ops.core.launcher import kernel_module_names
from cp_compile.ops.core.triton_common import CPU_MAX_PROGRAMS, Launch, LoweringDeclaration, capture_launches

_TRITON_DTYPES = {
    torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv",
}


@dataclass
class Result:
    """One checked specialisation, or one failure that has no specialisation."""

    module: str
    kernel: str
    status: str  # "ok" | "failed" | "absent" (LOWERING.not_on_ascend: the NPU declares no kernel, with why)
    stage: str  # where it stopped: declare, example, ttir, linalg, rules, npubin (or the last stage run)
    message: str = ""
    signature: dict[str, str] = field(default_factory=dict)
    constexprs: dict[str, Any] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    seconds: float = 0.0
    linalg_lines: int = 0


@dataclass
class _Spec:
    kernel: Any  # JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any]
    int64_reason: str | None  # the module's LOWERING.int64 entry for this kernel
    options: dict[str, int] = field(default_factory=dict)  # launch options the launcher passed (num_warps ...)
    examples: list[str] = field(default_factory=list)
    grids: set[tuple[int, ...]] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


# ----------------------------------------------------------------------------- discovery


def kernel_modules(targets: list[str] | None = None) -> list[ModuleType]:
    """Every family's Triton kernel modules, or the given module names / .py paths."""
    if not targets:
        # Every triton_*.py of the family folders (and core's shared ones).
        return [importlib.import_module(name) for name in kernel_module_names()]
    modules = []
    for target in targets:
        path = Path(target)
        if path.suffix == ".py":
            name = f"_lowering_check_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise FileNotFoundError(f"cannot import {target}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module  # jit needs the module importable by name
            spec.loader.exec_module(module)
            modules.append(module)
        else:
            modules.append(importlib.import_module(target))
    return modules


def jit_kernels(module: ModuleType) -> dict[str, Any]:
    """Every @triton.jit function defined in `module` (autotune / heuristics wrappers unwrapped)."""
    from triton.runtime.jit import JITFunction, KernelInterface

    found = {}
    for obj in vars(module).values():
        while isinstance(obj, KernelInterface) and not isinstance(obj, JITFunction):
            obj = obj.fn  # Autotuner / Heuristics -> the jitted function
        if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__:
            found[obj.fn.__name__] = obj
    return found


def _is_constexpr(param: inspect.Parameter) -> bool:
    import triton.language as tl

    ann = param.annotation
    return ann is tl.constexpr or (isinstance(ann, str) and ann.split(".")[-1] == "constexpr")


def _triton_type(name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        if value.dtype not in _TRITON_DTYPES:
            raise TypeError(f"argument {name}: no Triton type for {value.dtype}")
        return "*" + _TRITON_DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"  # as Triton's launcher specialises
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument {name}: cannot type {type(value).__name__} for Triton")


# Launch keywords that are compile options, not kernel parameters (`kernel[grid](..., num_warps=8)`).
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas")


def launch_options(launch: Launch) -> dict[str, int]:
    """The compile options a captured launch passed (num_warps ...), empty for the defaults."""
    return {k: int(v) for k, v in launch.kwargs.items() if k in LAUNCH_OPTIONS}


def specialise(launch: Launch) -> tuple[dict[str, str], dict[str, Any]]:
    """(runtime argument -> Triton type, constexpr -> value) of one captured launch (its
    compile options apart: `launch_options`)."""
    fn_signature = inspect.signature(launch.kernel.fn)
    params = fn_signature.parameters
    kwargs = {k: v for k, v in launch.kwargs.items() if k not in LAUNCH_OPTIONS}
    bound = fn_signature.bind(*launch.args, **kwargs)
    signature, constexprs = {}, {}
    for name, value in bound.arguments.items():
        if _is_constexpr(params[name]):
            constexprs[name] = value
        else:
            signature[name] = _triton_type(name, value)
    missing = [n for n, p in params.items() if n not in bound.arguments and p.default is inspect.Parameter.empty]
    if missing:
        raise TypeError(f"launch of {launch.kernel.fn.__name__} misses {missing}")
    return signature, constexprs


def collect(module: ModuleType) -> tuple[list[_Spec], list[Result]]:
    """The module's specialisations from its declared examples, and declaration failures."""
    kernels = jit_kernels(module)
    decl = getattr(module, "LOWERING", None)
    mod = module.__name__
    if not kernels and decl is None:
        return [], []
    if not isinstance(decl, LoweringDeclaration):
        return [], [Result(mod, k, "failed", "declare",
                           "module has @triton.jit kernels but no LOWERING = LoweringDeclaration(...) "
                           "(cp_compile.ops.core.triton_common): declare launches next to the kernel")
                    for k in kernels]
    failures = [Result(mod, k, "failed", "declare", f"LOWERING.{field} names {k!r}, not a kernel of this module")
                for field, names in (("int64", decl.int64), ("not_on_ascend", decl.not_on_ascend))
                for k in names if k not in kernels]
    for helper in decl.helpers:
        kernels.pop(helper, None)
    specs: dict[tuple, _Spec] = {}
    for label, thunk in decl.examples():
        with capture_launches() as launches:
            try:
                thunk()
            except Exception as exc:  # a broken example must not hide the others
                failures.append(Result(mod, "-", "failed", "example", f"{label}: {type(exc).__name__}: {exc}"))
                continue
        for launch in launches:
            name = launch.kernel.fn.__name__
            if name not in kernels:
                continue  # another module's kernel: checked with its own module
            signature, constexprs = specialise(launch)
            options = launch_options(launch)
            key = (name, tuple(signature.items()), tuple(constexprs.items()), tuple(options.items()))
            spec = specs.setdefault(key, _Spec(launch.kernel, signature, constexprs, decl.int64.get(name), options))
            spec.examples.append(label)
            spec.grids.add(launch.grid)
    launched = {s.name for s in specs.values()}
    failures += [Result(mod, k, "failed", "declare",
                        "no LOWERING example launches this kernel: add one (or list it in LOWERING.helpers "
                        "if it is a device function)") for k in kernels if k not in launched]
    return list(specs.values()), failures


# ----------------------------------------------------------------------------- rules


# A reduction's combine region: its element type and body (up to tt.reduce.return).
_REDUCE = re.compile(r'"tt\.reduce"\(.*?\^bb0\(%\w+: (\w+)(.*?)tt\.reduce\.return', re.DOTALL)
_DOT = re.compile(r"tt\.dot .*?-> tensor<[0-9x]+x(\w+)>")


def rule_violations(ttir: str, grids: set[tuple[int, ...]], int64_reason: str | None) -> list[str]:
    """docs/architecture.md §8 rules the adapter does not enforce (it accepted fp64 loads and int64
    atomics that the final NPU compile rejects), read off the TTIR and the launches."""
    bad = []
    for grid in sorted(grids):
        if len(grid) != 1 or grid[0] > CPU_MAX_PROGRAMS:
            bad.append(f"grid {grid}: launch a 1D grid of at most the core count (grid_size(...))")
    if re.search(r"tt\.get_(program_id|num_programs) [yz]\b", ttir):
        bad.append("2D/3D program ids: use a 1D persistent grid")
    if "tt.get_num_programs x" not in ttir:
        bad.append("not persistent: loop `for w in range(tl.program_id(0), n_work, tl.num_programs(0))`")
    if re.search(r"\bi64\b", ttir) and not int64_reason:
        bad.append("int64 values: index in int32 (require_int32_offsets in the launcher), or say why in "
                   "LOWERING.int64")
    if re.search(r"\bf64\b", ttir):
        bad.append("fp64: unsupported on the NPU")
    if re.search(r"tt\.atomic_(rmw|cas)", ttir):
        bad.append("atomics: not allowed (docs/architecture.md §8)")
    for dtype, body in _REDUCE.findall(ttir):
        # Sums and products must accumulate in fp32 (tl.sum upcasts bf16, not fp16);
        # a max / min is exact in any dtype.
        if dtype not in ("f32", "i32") and re.search(r"arith\.(add|mul)[if]", body):
            bad.append(f"sum or product reduced in {dtype}: accumulate in fp32")
    for dtype in _DOT.findall(ttir):
        if dtype not in ("f32", "i32"):
            bad.append(f"tl.dot accumulates in {dtype}: use an fp32 accumulator")
    return sorted(set(bad))


# ----------------------------------------------------------------------------- lowering


def _error_text(exc: Exception) -> str:
    detail = getattr(exc, "stderr", None)
    detail = detail.decode(errors="replace") if isinstance(detail, bytes) else (detail or "")
    return f"{type(exc).__name__}: {exc}\n{detail}".strip()


class _StageError(Exception):
    def __init__(self, stage: str, text: str) -> None:
        super().__init__(text)
        self.stage, self.text = stage, text


def lower(spec: _Spec, arch: str, npubin: bool) -> tuple[str, str, str]:
    """(stage reached, ttir, linalg) of one specialisation; raises with the failing stage."""
    import triton
    from triton._C.libtriton import ir
    from triton.backends.ascend import compiler as ascend
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    target = GPUTarget("npu", arch, 0)
    src = ASTSource(spec.kernel, spec.signature, spec.constexprs)
    backend = ascend.AscendBackend(target)
    options = backend.parse_options({})
    metadata = {"target": target, **options.__dict__}
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    stage = "ttir"
    try:
        module = src.make_ir(options, backend.get_codegen_implementation(), backend.get_module_map(), context)
        ttir = ascend.make_ttir(module, metadata, options)
        ttir_text = str(ttir)
        stage = "linalg"
        linalg = ascend.ttir_to_linalg(ttir, metadata, options, named_ops=True)
        if npubin:
            stage = "npubin"
            triton.compile(src, target=target)  # every stage, through bishengir-compile
    except Exception as exc:
        raise _StageError(stage, _error_text(exc)) from exc
    return stage, ttir_text, linalg


def check(modules: list[ModuleType], arch: str = "Ascend910B3", npubin: bool = False,
          dump: Path | None = None, progress: bool = True) -> list[Result]:
    """Lower and rule-check every specialisation of every kernel in `modules`."""
    results: list[Result] = []
    for module in modules:
        specs, failures = collect(module)
        results += failures
        for i, spec in enumerate(specs):
            if progress:
                print(f"[{module.__name__.rsplit('.', 1)[-1]} {i + 1}/{len(specs)}] {spec.name} "
                      f"{_short(spec.constexprs)}", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            res = Result(module.__name__, spec.name, "ok", "linalg", signature=spec.signature,
                         constexprs=spec.constexprs, examples=spec.examples)
            why_absent = getattr(module, "LOWERING").not_on_ascend.get(spec.name)
            if why_absent:  # declared: not lowered (it may abort the adapter), listed with its reason
                res.status, res.stage, res.message = "absent", "declared", why_absent
                results.append(res)
                continue
            try:
                res.stage, ttir, linalg = lower(spec, arch, npubin)
                res.linalg_lines = len(linalg.splitlines())
                violations = rule_violations(ttir, spec.grids, spec.int64_reason)
                if violations:
                    res.status, res.stage, res.message = "failed", "rules", "; ".join(violations)
                if dump:
                    dump.mkdir(parents=True, exist_ok=True)
                    stem = f"{spec.name}-{len(results)}"
                    (dump / f"{stem}.ttir").write_text(ttir)
                    (dump / f"{stem}.linalg.mlir").write_text(linalg)
            except _StageError as exc:
                res.status, res.stage, res.message = "failed", exc.stage, exc.text
            res.seconds = time.perf_counter() - t0
            results.append(res)
    return results


# ----------------------------------------------------------------------------- report


def _short(constexprs: dict[str, Any]) -> str:
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in constexprs.items())


def _first_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    pick = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "")
    return pick[:160]


def summary(results: list[Result]) -> dict[str, Any]:
    checked = [r for r in results if r.signature or r.constexprs]
    return {
        "kernels": len({(r.module, r.kernel) for r in checked}),
        "constexpr_sets": len({(r.module, r.kernel, tuple(r.constexprs.items())) for r in checked}),
        "specialisations": len(checked),
        "example_launches": sum(len(r.examples) for r in checked),
        "failed": sum(r.status == "failed" for r in results),
        "absent": sum(r.status == "absent" for r in results),
        "seconds": round(sum(r.seconds for r in results), 2),
    }


def report(results: list[Result], arch: str, stage: str) -> str:
    rows = []
    for r in results:
        types = ",".join(sorted({t[1:] for t in r.signature.values() if t.startswith("*")}))
        detail = (f"{r.linalg_lines} linalg lines" if r.status == "ok" else r.message if r.status == "absent"
                  else _first_error_line(r.message))
        rows.append((r.kernel, _short(r.constexprs) or "-", types or "-", str(len(r.examples)),
                     r.status if r.status in ("ok", "absent") else f"FAILED at {r.stage}", f"{r.seconds:.2f}", detail))
    headers = ("kernel", "constexprs", "pointer dtypes", "launches", "result", "s", "detail")
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip()
             for row in [headers, tuple("-" * w for w in widths), *rows]]
    s = summary(results)
    lines.append(
        f"\nTriton-Ascend lowering ({stage}, {arch}): {s['kernels']} kernels, {s['constexpr_sets']} constexpr sets, "
        f"{s['specialisations']} specialisations (from {s['example_launches']} example launches), "
        f"{s['failed']} failed, {s['seconds']:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("modules", nargs="*", help="module names or .py files (default: every ops/<family>/triton_*.py)")
    parser.add_argument("--arch", default="Ascend910B3")
    parser.add_argument("--npubin", action="store_true", help="also run bishengir-compile (needs CANN)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--dump", type=Path, help="write each specialisation's .ttir / .linalg.mlir here")
    args = parser.parse_args(argv)
    try:
        from triton.backends.ascend import compiler
    except ImportError as exc:
        print(f"triton-ascend is not importable here ({exc}); run in .venv-ascend "
              "(bash tools/bootstrap.sh --with-ascend)", file=sys.stderr)
        return 2
    if args.npubin and shutil.which("bishengir-compile") is None:
        print("--npubin needs bishengir-compile on PATH (source CANN's set_env.sh)", file=sys.stderr)
        return 2
    results = check(kernel_modules(args.modules), args.arch, args.npubin, args.dump)
    stage = "TTIR -> linalg -> npubin" if args.npubin else "TTIR -> linalg"
    print(report(results, args.arch, stage))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"arch": args.arch, "stage": stage, "summary": summary(results),
                                         "results": [vars(r) for r in results]}, indent=1, default=str))
    return 1 if any(r.status == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
