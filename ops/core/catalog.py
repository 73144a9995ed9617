"""Every `cp::` op's declaration, collected from the op families (docs/architecture.md §12).

`OPS` is the one list the rest of the project reads: the kernel registration
(`core/registry.py`, at `import cp_compile.ops`), the GE converter registration
(`core/ge_registry.register_converters`, when the torchair lowering first runs:
torchair is an optional dependency, imported only there), the GE check's expected op
types, the benchmark profile buckets and the generated op table (`python -m
tools.op_table`). A new op family's op module is added to `FAMILIES`.

The catalog sits above the families (it imports them) and below the parallel
compositions: the layers contract of pyproject.toml says so.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core.spec import GE, Absent, OpDecl, Reference, TritonAscend
from cp_compile.ops.merge import ops as merge_ops
from cp_compile.ops.mla_preprocess import ops as mla_preprocess_ops
from cp_compile.ops.paged import ops as paged_ops
from cp_compile.ops.pcp import ops as pcp_ops
from cp_compile.ops.quant import ops as quant_ops
from cp_compile.ops.sparse import dsa_cp as sparse_dsa_cp_ops
from cp_compile.ops.sparse import ops as sparse_ops

# The modules that declare ops (`OPS`), one or more per family folder.
FAMILIES = (paged_ops, merge_ops, sparse_ops, sparse_dsa_cp_ops, quant_ops, mla_preprocess_ops, pcp_ops)
OPS: tuple[OpDecl, ...] = tuple(decl for family in FAMILIES for decl in family.OPS)
BY_NAME: dict[str, OpDecl] = {decl.name: decl for decl in OPS}

# The single-device attention ops of every family (each family lists its own): a pass
# must replace or claim each of these nodes under DCP / PCP (passes/unsharded_attention.py).
SINGLE_DEVICE_ATTENTION_OPS: tuple[torch._ops.OpOverloadPacket, ...] = (
    paged_ops.SINGLE_DEVICE_ATTENTION_OPS + sparse_ops.SINGLE_DEVICE_ATTENTION_OPS)

_OPS_PACKAGE = __name__.rsplit(".", 2)[0]  # cp_compile.ops
# GE helpers every converter module may import (torchair's builders, the cache scatter),
# and the converters of aten ops that replace torchair's (each module's `register()`):
# aten.constant_pad_nd of a symbolic amount (the DSA-CP token pad).
GE_HELPER_MODULES = (f"{_OPS_PACKAGE}.core.ge_util", f"{_OPS_PACKAGE}.core.ge_kv_quant")
GE_ATEN_MODULES = (f"{_OPS_PACKAGE}.core.ge_aten_pad",)


def ge_ops() -> dict[str, tuple[str, ...]]:
    """op -> the GE op types its converted graph contains (ops with a converter)."""
    return {d.name: d.ge.emits for d in OPS if isinstance(d.ge, GE)}


def profile_buckets() -> dict[str, str]:
    """op -> the benchmark profile bucket of its time."""
    return {d.name: d.profile for d in OPS}


def ge_converter_modules() -> tuple[str, ...]:
    """Dotted names of the modules holding a declared `convert_<op>`, each once, in
    family order (a family's modules sorted), so a module comes after the family
    modules it imports (mla_preprocess reads quant's converter)."""
    seen: dict[str, None] = {}
    for family in FAMILIES:
        modules = sorted({d.ge_module for d in family.OPS if isinstance(d.ge, GE)})
        seen.update(dict.fromkeys(modules))
    return tuple(seen)


def converter_modules() -> list[str]:
    """Dotted module names of every GE converter module and the helpers they import:
    the helpers first, then the declared converter modules, then the aten converters.
    The GE check loads (mutated) copies of exactly these (tools/ge_check.py)."""
    return [*GE_HELPER_MODULES, *ge_converter_modules(), *GE_ATEN_MODULES]


def module_path(module: str) -> str:
    """'cp_compile.ops.paged.ge' -> 'paged/ge.py': a module's file below ops/."""
    return module.removeprefix(_OPS_PACKAGE + ".").replace(".", "/") + ".py"


def _cell(piece: object) -> str:
    if isinstance(piece, Absent):
        return f"— ({piece.why})"
    if isinstance(piece, TritonAscend):
        return "the CUDA kernel (Triton through triton-ascend)"
    if isinstance(piece, GE):
        raise TypeError("a GE cell names its module: _ge_cell")
    return f"`{module_path(piece.__module__)}: {piece.__name__}`"  # type: ignore[attr-defined]


def _ge_cell(decl: OpDecl) -> str:
    if not isinstance(decl.ge, GE):
        return _cell(decl.ge)
    return f"`{module_path(decl.ge_module)}`: {', '.join(decl.ge.emits)}"


def table() -> str:
    """The op x (CPU, CUDA, NPU eager, GE) table, as markdown."""
    rows = ["| op | CPU | CUDA | NPU eager | GE graph | profile |", "|---|---|---|---|---|---|"]
    for d in OPS:
        cpu = (f"`{module_path(d.op._init_fn.__module__)}` body" if isinstance(d.cpu, Reference) else
               f"`{module_path(d.cpu.__module__)}: {d.cpu.__name__}` (oracle: the body)")
        rows.append(f"| `{d.name}` | {cpu} | {_cell(d.cuda)} | {_cell(d.npu)} | "
                    f"{_ge_cell(d)} | {d.profile} |")
    return "\n".join(rows) + "\n"
