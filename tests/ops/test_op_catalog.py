"""One op, one place: every `cp::` op is declared in its family folder (ops/core/spec.py).

Walks every op of the `cp` namespace: it has a schema (the custom op), a fake, a
declaration with every piece present or `Absent` with a reason, a GE converter where
the declaration says (read from the converter module's source: torchair is not in
this environment), kernels registered as declared, and the generated op table in
docs/architecture.md equals the committed one. Each check is shown failing on a
broken declaration.
"""

from __future__ import annotations

import ast
import re
import dataclasses
from pathlib import Path

import pytest
import torch
from torch._library import simple_registry

import cp_compile.ops  # noqa: F401  (defines and registers the ops)
from cp_compile.ops.core import catalog
from cp_compile.ops.core import registry
from cp_compile.ops.core.spec import Absent, GE, OpDecl, TRITON_ASCEND, TritonAscend
from tools import op_table

REPO = Path(__file__).resolve().parents[2]


def problems(decl: OpDecl) -> list[str]:
    """What is missing or wrong about one op's declaration."""
    out = []
    name = decl.name
    if simple_registry.singleton.find(name).fake_impl.kernel is None:
        out.append(f"{name}: no fake (register_fake next to the op)")
    for piece in ("cuda", "npu", "ge"):
        value = getattr(decl, piece)
        if isinstance(value, Absent):
            pass  # Absent("") cannot be built: the reason is checked at construction
        elif piece == "ge":
            if not isinstance(value, GE) or not value.emits:
                out.append(f"{name}: ge is neither GE(module, *emitted GE ops) nor Absent(why)")
            else:
                out.extend(f"{name}: {e}" for e in ge_converter_problems(decl, value))
        elif piece == "npu" and isinstance(value, TritonAscend):
            if not callable(decl.cuda):
                out.append(f"{name}: npu is TRITON_ASCEND but there is no cuda kernel")
        elif not callable(value):
            out.append(f"{name}: {piece} is neither a kernel nor Absent(why)")
    if decl.profile not in ("attention", "dcp_local", "other"):
        out.append(f"{name}: profile bucket {decl.profile!r} is not one of attention, dcp_local, other")
    return out


def ge_converter_problems(decl: OpDecl, ge: GE) -> list[str]:
    # the converter module sits in the op's family folder (OpDecl.ge_module)
    rel = catalog.module_path(f"{decl.family}.{ge.module}")
    path = REPO / "ops" / rel
    if not path.exists():
        return [f"GE converter module ops/{rel} does not exist"]
    defined = {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)}
    if ge.converter(decl.name) not in defined:
        return [f"ops/{rel} defines no {ge.converter(decl.name)}"]
    return []


def test_every_cp_op_is_declared_with_every_piece() -> None:
    defined = registry.cp_ops()
    assert len(defined) >= 17
    assert sorted(catalog.BY_NAME) == defined, (
        f"ops without a declaration: {sorted(set(defined) - set(catalog.BY_NAME))}; declared but not defined: "
        f"{sorted(set(catalog.BY_NAME) - set(defined))}. Fix: add an OpDecl to the family module's OPS")
    assert len(catalog.OPS) == len(catalog.BY_NAME), "an op is declared twice"
    bad = [p for decl in catalog.OPS for p in problems(decl)]
    assert not bad, "\n".join(bad)


def test_the_walk_fails_on_a_broken_declaration() -> None:
    decl = catalog.BY_NAME["cp::lse_combine"]
    assert problems(decl) == []
    assert problems(dataclasses.replace(decl, cuda=None)) == ["cp::lse_combine: cuda is neither a kernel nor Absent(why)"]
    assert problems(dataclasses.replace(decl, ge=GE("launch", "AttentionUpdate"))) == [
        "cp::lse_combine: ops/merge/launch.py defines no convert_lse_combine"]
    assert problems(dataclasses.replace(decl, ge=GE("nowhere", "AttentionUpdate"))) == [
        "cp::lse_combine: GE converter module ops/merge/nowhere.py does not exist"]
    assert problems(dataclasses.replace(decl, cuda=Absent("not written"), npu=TRITON_ASCEND)) == [
        "cp::lse_combine: npu is TRITON_ASCEND but there is no cuda kernel"]
    assert problems(dataclasses.replace(decl, profile="elsewhere")) == [
        "cp::lse_combine: profile bucket 'elsewhere' is not one of attention, dcp_local, other"]
    with pytest.raises(ValueError, match="say why"):
        Absent(" ")
    with pytest.raises(ValueError, match="name the GE op types"):
        GE("merge")


def test_kernels_are_registered_as_declared() -> None:
    regs = registry.register_device_kernels()
    for decl in catalog.OPS:
        assert f"{decl.name}@cuda" in regs
        assert torch._C._dispatch_has_kernel_for_dispatch_key(decl.name, "CUDA"), decl.name
    table = registry.kernel_table("cuda", triton_ok=True)
    for decl in catalog.OPS:
        if callable(decl.cuda):
            assert table[decl.name] is decl.cuda
        else:
            with pytest.raises(registry.MissingDeviceKernel, match=re.escape(decl.cuda.why)):
                table[decl.name]()


def test_profile_buckets_come_from_the_declarations() -> None:
    from examples.bench import profile

    for decl in catalog.OPS:  # the breakdown charges each op to its declared bucket ("other": no bucket)
        assert profile._bucket(decl.name) == (None if decl.profile == "other" else decl.profile), decl.name


def test_committed_op_table_is_the_generated_one() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    assert op_table.committed(text) == catalog.table(), (
        "docs/architecture.md's op table is stale. Fix: .venv/bin/python -m tools.op_table --write")
    # The comparison can fail: a table with one cell changed is not the generated one.
    assert op_table.committed(op_table.replace(text, catalog.table().replace("dcp_local", "other", 1))) \
        != catalog.table()
