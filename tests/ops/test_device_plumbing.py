"""Device plumbing without an accelerator (issue 22).

- every tensor factory on a step's path names its device (a static scan of the
  source, and the scan shown failing on an injected `torch.arange(n)`);
- `init_parallel` binds the current CUDA / NPU device from the local rank;
- the HF Engine allocates caches, metadata and inputs on the model's device (a
  model on the `meta` device: a CPU tensor anywhere would show);
- every cp:: op has an accelerator kernel, and one without a device kernel (or
  without triton) raises an error naming the op instead of running the reference.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch

import cp_compile.ops  # noqa: F401  (defines and registers the ops)
from cp_compile.ops.core import registry
from cp_compile.ops.core.spec import Absent
from cp_compile.runtime.parallel_state import bind_device
from cp_compile.testing.device_modes import FACTORIES, FactoryDeviceMode

REPO = Path(__file__).resolve().parents[2]

# What a step runs: the ops, their kernels' launchers, the parallel compositions, the
# graph passes (they build nodes, and any tensor they make lands in the graph) and the
# HF serving path. Not here: cp_compile/runtime/metadata_build.py (builds a step's metadata from
# Python lists on the host, then `.to(device)` once, by design), serving/hf/tp.py (load-time
# weight indices, moved to the weight's device where used), tools/ge_check/ (CPU-only
# GE conversion cases), and `_lowering_examples` (CPU tensors for launch capture).
# ops/paged/cpu.py is left out: its kernels are registered for the cpu dispatch key only
# (OpDecl.cpu), so a factory there can only ever make a tensor on the device it runs on.
# Every op module but the GE converters (ge*.py: GE graph builders, no torch tensors) and
# the paged family's CPU kernel (CPU only), then the compositions.
STEP_PATH = [*sorted(p for p in (REPO / "ops").rglob("*.py") if "parallel" not in p.relative_to(REPO / "ops").parts
                     and not p.name.startswith("ge") and p.relative_to(REPO / "ops").as_posix() != "paged/cpu.py"),
             *sorted((REPO / "ops" / "parallel").glob("*.py")), *sorted((REPO / "passes").glob("*.py")),
             *(REPO / "cp_compile" / "serving" / "hf" / name for name in ("engine.py", "attention.py", "cache.py")),
             REPO / "cp_compile" / "runtime" / "kv_cache.py"]
EXEMPT_FUNCTIONS = {"_lowering_examples"}
FACTORY_NAMES = {f.__name__ for f in FACTORIES}


def factories_without_device(source: str, filename: str = "<src>") -> list[str]:
    """`torch.<factory>(...)` calls with no `device=` keyword, outside exempt functions."""
    found: list[str] = []

    def visit(node: ast.AST, exempt: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            exempt = exempt or node.name in EXEMPT_FUNCTIONS
        if (not exempt and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORY_NAMES
                and not any(k.arg == "device" or k.arg is None for k in node.keywords)):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child, exempt)

    visit(ast.parse(source), False)
    return found


def test_every_step_path_factory_names_its_device() -> None:
    assert len(STEP_PATH) > 20 and all(p.exists() for p in STEP_PATH)
    bad = [hit for p in STEP_PATH for hit in factories_without_device(p.read_text(), str(p.relative_to(REPO)))]
    assert not bad, ("tensor factories without device= on the step path (a CPU tensor on an accelerator "
                     "step); pass device=<an input>.device:\n" + "\n".join(bad))


def test_factory_scan_fails_on_an_injected_arange() -> None:
    src = (REPO / "ops" / "merge" / "ops.py").read_text()
    assert factories_without_device(src) == []
    anchor = "    merged = reference.merge_partials(outs, lses)\n"  # a line of cp::lse_combine's body
    injected = src.replace(anchor, "    pad = torch.arange(outs.shape[0])\n" + anchor, 1)
    assert injected != src
    hits = factories_without_device(injected, "ops/merge/ops.py")
    assert len(hits) == 1 and "torch.arange(outs.shape[0])" in hits[0], hits
    # device=... (or **kwargs carrying it) passes; the lowering examples are exempt.
    assert factories_without_device("torch.arange(3, device=x.device)\ntorch.zeros(2, **kw)") == []
    assert factories_without_device("def _lowering_examples():\n    torch.empty(3)") == []


def test_factory_mode_records_a_factory_without_device() -> None:
    x = torch.ones(3)
    with FactoryDeviceMode() as mode:
        torch.arange(4, device=x.device)
        torch.zeros_like(x)
    assert mode.missing == []
    with FactoryDeviceMode() as mode:
        torch.arange(4)
    assert mode.missing == ["torch.arange(4,)"]


# ----------------------------------------------------------------------------- current device


def test_bind_device_uses_the_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append(i))
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert bind_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert bind_device(torch.device("cuda", 1)) == torch.device("cuda", 1)  # an explicit index wins
    assert calls == [3, 1]
    assert bind_device(torch.device("cpu")) == torch.device("cpu") and calls == [3, 1]


# ----------------------------------------------------------------------------- HF engine


def test_hf_engine_allocates_on_the_model_device() -> None:
    import cp_compile
    import cp_compile.serving.hf
    from examples.hf_generate import tiny_hf

    model = tiny_hf("qwen3").to("meta")  # any CPU tensor the engine makes would show as device cpu
    engine = cp_compile.serving.hf.Engine(model, cp_compile.CPConfig(block_size=4), num_blocks=4, progress=False)
    assert engine.device == torch.device("meta")
    assert {t.device.type for layer in engine.cache.layers for t in layer} == {"meta"}
    ids, meta = engine._inputs([(0, 0, [1, 2, 3])])  # (request id, cached tokens, new tokens)
    assert ids.device.type == "meta"
    assert {getattr(meta, f).device.type for f in ("query_start_loc", "seq_lens", "block_table", "slot_mapping",
                                                  "positions")} == {"meta"}


# ----------------------------------------------------------------------------- accelerator kernels


def test_every_op_has_an_accelerator_kernel() -> None:
    ops = registry.cp_ops()
    assert len(ops) >= 17
    regs = registry.register_device_kernels()
    for op in ops:
        assert f"{op}@cuda" in regs
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA"), op


def test_an_op_without_a_device_kernel_is_an_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without triton every op refuses, by name, with the fix (an op declared with no kernel at all,
    # e.g. the cp::pcp_token_index graph marker, with its declared reason).
    absent = registry.ops_without_kernel()
    for op, fn in registry.kernel_table("cuda", triton_ok=False).items():
        why = re.escape(absent[op]) if op in absent else "triton is not installed"
        with pytest.raises(registry.MissingDeviceKernel, match=f"{op} has no cuda kernel: {why}"):
            fn()
    # With triton, an op whose declaration has no kernel refuses with the declared reason
    # (all 16 have one: drop one to see it); the others get the declared kernel (NPU: a
    # torch_npu fused op where declared, else the CUDA entry through triton-ascend).
    ops = tuple(dataclasses.replace(d, cuda=Absent("dropped for this test")) if d.name == "cp::lse_rescale" else d
                for d in registry.OPS)
    monkeypatch.setattr(registry, "OPS", ops)
    table = registry.kernel_table("npu", triton_ok=True)
    assert set(table) == set(registry.cp_ops())
    for decl in ops:
        if decl.name == "cp::lse_rescale":
            with pytest.raises(registry.MissingDeviceKernel,
                               match="cp::lse_rescale has no npu kernel: dropped for this test"):
                table[decl.name]()
        elif decl.name in absent:
            with pytest.raises(registry.MissingDeviceKernel, match=re.escape(absent[decl.name])):
                table[decl.name]()
        elif isinstance(decl.npu, Absent):  # a CUDA kernel but none on the NPU (none today: decision 70 gave the quantised KV ops theirs)
            with pytest.raises(registry.MissingDeviceKernel, match=re.escape(decl.npu.why)):
                table[decl.name]()
        else:
            assert table[decl.name] is (decl.npu if callable(decl.npu) else decl.cuda), decl.name
