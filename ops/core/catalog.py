"""Every `cp::` op's declaration, collected from the op family modules (docs/architecture.md §12).

`OPS` is the one list the rest of the project reads: the kernel registration
(`kernels/registry.py`, at `import cp_compile.ops`), the GE converter registration
(`ge.register_converters`, when the torchair lowering first runs: torchair is an
optional dependency, imported only there), the GE check's expected op types, the
benchmark profile buckets and the generated op table (`python -m tools.op_table`).
A new op family module is added to `FAMILIES`.
"""

from __future__ import annotations

from cp_compile.ops import attention, dcp, dsa_cp, mla_preprocess, pcp, quant
from cp_compile.ops.spec import GE, Absent, OpDecl, Reference, TritonAscend

FAMILIES = (attention, dcp, dsa_cp, quant, mla_preprocess, pcp)
OPS: tuple[OpDecl, ...] = tuple(decl for family in FAMILIES for decl in family.OPS)
BY_NAME: dict[str, OpDecl] = {decl.name: decl for decl in OPS}


def ge_ops() -> dict[str, tuple[str, ...]]:
    """op -> the GE op types its converted graph contains (ops with a converter)."""
    return {d.name: d.ge.emits for d in OPS if isinstance(d.ge, GE)}


def profile_buckets() -> dict[str, str]:
    """op -> the benchmark profile bucket of its time."""
    return {d.name: d.profile for d in OPS}


def _cell(piece: object) -> str:
    if isinstance(piece, Absent):
        return f"— ({piece.why})"
    if isinstance(piece, TritonAscend):
        return "the CUDA kernel (Triton through triton-ascend)"
    if isinstance(piece, GE):
        return f"`ge/{piece.module}.py`: {', '.join(piece.emits)}"
    module = piece.__module__.rsplit(".", 1)[-1]  # type: ignore[attr-defined]
    return f"`kernels/{module}.py: {piece.__name__}`"  # type: ignore[attr-defined]


def table() -> str:
    """The op x (CPU, CUDA, NPU eager, GE) table, as markdown."""
    rows = ["| op | CPU | CUDA | NPU eager | GE graph | profile |", "|---|---|---|---|---|---|"]
    for d in OPS:
        family = d.op._init_fn.__module__.rsplit(".", 1)[-1]
        cpu = (f"`{family}.py` body" if isinstance(d.cpu, Reference) else
               f"`{d.cpu.__module__.rsplit('.', 1)[-1]}.py: {d.cpu.__name__}` (oracle: the body)")
        rows.append(f"| `{d.name}` | {cpu} | {_cell(d.cuda)} | {_cell(d.npu)} | "
                    f"{_cell(d.ge)} | {d.profile} |")
    return "\n".join(rows) + "\n"
