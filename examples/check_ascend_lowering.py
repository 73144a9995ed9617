"""Check that the Triton kernels lower for Ascend without an NPU (DESIGN.md §8).

Runs triton-ascend's NPU-specific front half of the compile: Python AST -> TTIR
(`make_ttir`) -> linalg (`ttir_to_linalg(named_ops=True)`, the shipped
`triton-adapter-opt`) for every kernel in cp_compile.ops.kernels, and prints a table.
The last step (`bishengir-compile`, from CANN) needs the Ascend toolkit and is not run.

triton-ascend owns the `triton` module name, so use its own virtual environment:

    python3 -m venv /tmp/ta
    /tmp/ta/bin/pip install torch==2.13.0 triton-ascend==3.2.0 pybind11
    /tmp/ta/bin/pip install --no-deps -e .
    /tmp/ta/bin/python examples/check_ascend_lowering.py [--arch Ascend910B3] [--dump DIR]

Exit status 0 when every kernel lowered.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Case:
    name: str
    kernel: Any  # a triton JITFunction
    signature: dict[str, str]  # runtime argument -> Triton type ("*fp16", "i32", "fp32")
    constants: dict[str, Any]  # constexpr arguments


def _signature(kernel: Any, types: dict[str, str], default: str = "i32") -> dict[str, str]:
    """Every non-constexpr parameter in order; pointers and floats named, ints default."""
    return {p.name: types.get(p.name, default) for p in kernel.params if not p.is_constexpr}


def cases() -> list[Case]:
    from cp_compile.ops.kernels.localize_slots import _local_slot_mapping_kernel
    from cp_compile.ops.kernels.lse_merge import _lse_rescale_kernel, _merge_partials_kernel
    from cp_compile.ops.kernels.paged_decode_lse import _paged_attention_lse_kernel

    paged = _paged_attention_lse_kernel

    def paged_types(act: str) -> dict[str, str]:
        return {"q_ptr": act, "k_ptr": act, "v_ptr": act, "bt_ptr": "*i32", "req_ptr": "*i32",
                "kvlen_ptr": "*i32", "out_ptr": act, "lse_ptr": "*fp32", "scale": "fp32"}

    merge_types = {"outs_ptr": "*bf16", "lses_ptr": "*fp32", "res_ptr": "*fp32", "lse_out_ptr": "*fp32"}
    rescale_types = {"out_ptr": "*bf16", "lse_ptr": "*fp32", "lse_all_ptr": "*fp32", "res_ptr": "*fp32",
                     "lse_out_ptr": "*fp32"}
    return [
        Case("paged_attention_with_lse GQA bf16 (group 8, D 128)", paged, _signature(paged, paged_types("*bf16")),
             dict(BLOCK_H=8, BLOCK_N=8, D_PAD=128, DV_PAD=128, USE_DOT=False)),
        Case("paged_attention_with_lse GQA fp16 (group 3, D 96)", paged, _signature(paged, paged_types("*fp16")),
             dict(BLOCK_H=4, BLOCK_N=16, D_PAD=128, DV_PAD=128, USE_DOT=False)),
        Case("paged_attention_with_lse MLA bf16 (576/512, sum)", paged, _signature(paged, paged_types("*bf16")),
             dict(BLOCK_H=1, BLOCK_N=8, D_PAD=1024, DV_PAD=512, USE_DOT=False)),
        Case("paged_attention_with_lse MLA bf16 (576/512, tl.dot)", paged, _signature(paged, paged_types("*bf16")),
             dict(BLOCK_H=16, BLOCK_N=16, D_PAD=1024, DV_PAD=512, USE_DOT=True)),
        Case("merge_partials (lse_out)", _merge_partials_kernel, _signature(_merge_partials_kernel, merge_types),
             dict(BLOCK_R=16, DV_PAD=128, WRITE_LSE=True)),
        Case("lse_rescale (lse_out)", _lse_rescale_kernel, _signature(_lse_rescale_kernel, rescale_types),
             dict(BLOCK_R=16, DV_PAD=128, WRITE_LSE=True)),
        Case("local_slot_mapping int64", _local_slot_mapping_kernel,
             _signature(_local_slot_mapping_kernel, {"slot_ptr": "*i64", "res_ptr": "*i64"}),
             dict(BLOCK=1024)),
    ]


def lower(case: Case, arch: str) -> tuple[str, str]:
    """(ttir, linalg) text of one kernel through triton-ascend's NPU stages."""
    from triton.backends.ascend import compiler as ascend
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource
    from triton._C.libtriton import ir

    target = GPUTarget("npu", arch, 0)
    backend = ascend.AscendBackend(target)
    options = backend.parse_options({})
    metadata = {"target": target, **options.__dict__}
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    src = ASTSource(case.kernel, case.signature, case.constants)
    module = src.make_ir(options, backend.get_codegen_implementation(), backend.get_module_map(), context)
    ttir = ascend.make_ttir(module, metadata, options)
    ttir_text = str(ttir)
    linalg = ascend.ttir_to_linalg(ttir, metadata, options, named_ops=True)
    return ttir_text, linalg


def summarize(linalg: str) -> str:
    ops = re.findall(r"\b(linalg\.[a-z_]+|scf\.for|hivm\.[a-z_.]+|memref\.copy)\b", linalg)
    counts: dict[str, int] = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    top = sorted(counts.items(), key=lambda kv: -kv[1])[:5]
    return ", ".join(f"{k.split('.', 1)[1]}x{v}" for k, v in top)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default="Ascend910B3")
    parser.add_argument("--dump", type=Path, default=None, help="write each kernel's .ttir / .linalg.mlir here")
    args = parser.parse_args()
    try:
        from triton.backends.ascend import compiler  # noqa: F401
    except ImportError as exc:
        print(f"triton-ascend is not installed in this environment ({exc}); see this script's docstring")
        return 2

    rows, failed = [], 0
    for case in cases():
        t0 = time.perf_counter()
        try:
            ttir, linalg = lower(case, args.arch)
        except Exception as exc:  # report every kernel, not just the first failure
            failed += 1
            detail = getattr(exc, "stderr", None)
            detail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(exc)
            first = next((ln for ln in detail.splitlines() if "error" in ln.lower()), detail.splitlines()[0] if detail else "")
            rows.append((case.name, "FAIL", f"{time.perf_counter() - t0:.1f}", "-", first.strip()[:120]))
            continue
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            stem = re.sub(r"[^A-Za-z0-9]+", "_", case.name).strip("_")
            (args.dump / f"{stem}.ttir").write_text(ttir)
            (args.dump / f"{stem}.linalg.mlir").write_text(linalg)
        rows.append((case.name, "ok", f"{time.perf_counter() - t0:.1f}",
                     str(len(linalg.splitlines())), summarize(linalg)))

    headers = ("kernel", "linalg", "s", "lines", "main ops")
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)))
    print(f"\n{len(rows) - failed}/{len(rows)} kernels lowered TTIR -> linalg for {args.arch} "
          "(bishengir-compile, the CANN step after this, is not run)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
