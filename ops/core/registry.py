"""Register every cp:: op's declared accelerator kernels, at one moment (`import cp_compile.ops`).

The kernels are the ones each op family declares (`OPS`, core/spec.py): CUDA
(and, with torch_npu, the NPU: a torch_npu fused op where declared, else the CUDA
entry through triton-ascend).

CPU runs the torch reference, or the op's declared CPU kernel (`OpDecl.cpu`:
pure torch, e.g. `paged/cpu.py`), so a CPU `torch.compile` never traces into
Triton. Registration itself imports no triton: each kernel body fetches its
launcher on first call. Every `cp::` op gets an accelerator kernel: its device
kernel, or, when it has none (or triton is not installed), a kernel that raises
`MissingDeviceKernel` naming the op and the fix. A reference never serves an
accelerator silently: its Python loops and host reads cannot be captured in a
CUDA graph / aclgraph and would only look like they work.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core.catalog import OPS, SINGLE_DEVICE_ATTENTION_OPS
from cp_compile.ops.core.launcher import triton_available
from cp_compile.ops.core.sharded_cache import SINGLE_DEVICE_OP_RUNS, refuse_sharded
from cp_compile.ops.core.spec import Absent, TritonAscend

_REGISTERED: list[str] = []

# op -> its accelerator (CUDA; NPU through triton-ascend) kernel, from the declarations.
SINGLE_DEVICE = {op._qualified_op_name for op in SINGLE_DEVICE_ATTENTION_OPS}
DEVICE_KERNELS = {d.name: d.cuda for d in OPS if callable(d.cuda)}


def ops_without_kernel(ops=OPS) -> dict[str, str]:
    """op -> the reason it declares for having no accelerator kernel (`OpDecl.cuda =
    Absent(why)`; NPU falls back to the CUDA entry), for the ops that declare none."""
    return {d.name: d.cuda.why for d in ops if isinstance(d.cuda, Absent)}


class MissingDeviceKernel(NotImplementedError):
    """A cp:: op was called on an accelerator that has no kernel for it."""


def refusing_kernel(op: str, device: str, reason: str, fix: str):
    """A kernel for `op` on `device` that raises `MissingDeviceKernel` (the op's name, why, the fix)."""

    def refuse(*args, **kwargs):
        raise MissingDeviceKernel(
            f"{op} has no {device} kernel: {reason}. The CPU torch reference is not used on an accelerator "
            f"(host reads, Python loops over requests). Fix: {fix}")

    refuse.__name__ = f"refuse_{op.replace('::', '_')}"
    return refuse


def cp_ops() -> list[str]:
    """Every op of the `cp` namespace defined so far ('cp::name')."""
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("cp::"))


def kernel_table(device: str, triton_ok: bool) -> dict[str, object]:
    """op -> the kernel registered for `device` ("cuda" or "npu"), as each op declares it
    (`OpDecl.cuda`, `OpDecl.npu`), or a refusal naming the op: the declared reason, or
    "triton is not installed" for a Triton kernel without triton."""
    table = {}
    no_triton = ("triton is not installed", "install triton (pip install triton; triton-ascend on NPU), or run on CPU")
    for decl in OPS:
        if device == "npu" and callable(decl.npu):  # a torch_npu fused op: needs no triton
            table[decl.name] = decl.npu
            continue
        piece = decl.cuda if device == "cuda" or isinstance(decl.npu, TritonAscend) else decl.npu
        if isinstance(piece, Absent):
            table[decl.name] = refusing_kernel(decl.name, device, piece.why,
                                               f"declare one in the op's OpDecl ({decl.op._init_fn.__module__}), "
                                               "or run on CPU")
        elif not triton_ok:
            table[decl.name] = refusing_kernel(decl.name, device, *no_triton)
        else:
            table[decl.name] = piece
    return table


def device_types() -> list[str]:
    """Devices whose kernels are Triton: CUDA always, the NPU when torch_npu imports."""
    types = ["cuda"]
    try:
        import torch_npu  # noqa: F401  (renames PrivateUse1 to "npu")

        types.append("npu")
    except (ImportError, OSError, RuntimeError):  # not installed, or no Ascend driver libraries
        pass
    return types


def _refusing_sharded_caches(op: str, fn):
    """A single-device attention op's device kernel, refusing a DCP / PCP-sharded
    cache first (as the CPU reference does in `core/paged_cache.check_paged_step`; issue 19)."""
    schema = getattr(torch.ops.cp, op.split("::", 1)[1]).default._schema
    written = [(i, a.name) for i, a in enumerate(schema.arguments)
               if a.alias_info is not None and a.alias_info.is_write]

    def run(*args, **kwargs):
        refuse_sharded(((f"the cache of {op}", args[i] if i < len(args) else kwargs[n]) for i, n in written),
                       SINGLE_DEVICE_OP_RUNS)
        return fn(*args, **kwargs)

    run.__name__ = getattr(fn, "__name__", "kernel")
    return run


def register_device_kernels() -> list[str]:
    """Idempotent; returns the '<op>@<device>' registrations made (refusals included)."""
    if _REGISTERED:
        return _REGISTERED
    triton_ok = triton_available()
    for decl in OPS:
        if callable(decl.cpu):
            torch.library.register_kernel(decl.name, "cpu", decl.cpu)
            _REGISTERED.append(f"{decl.name}@cpu")
    for device in device_types():
        for op, fn in kernel_table(device, triton_ok).items():
            if op in SINGLE_DEVICE:
                fn = _refusing_sharded_caches(op, fn)
            torch.library.register_kernel(op, device, fn)
            _REGISTERED.append(f"{op}@{device}")
    return _REGISTERED
