"""Torch-function modes that catch what breaks an accelerator step, on CPU (issue 22).

- `HostReadMode`: raises on every data-dependent host read - `.item()`, `.tolist()`,
  `int(t)` / `float(t)` / `bool(t)` / `t.__index__`, `.numpy()`, `nonzero`,
  `masked_select`, boolean-mask indexing, `torch.unique` ... A CUDA graph or an
  aclgraph cannot capture any of them (each waits for the device), so a device
  wrapper run under this mode proves it has none.
- `FactoryDeviceMode`: records every tensor factory (`torch.arange`, `torch.zeros`,
  `torch.tensor` ...) called without `device=`: on an accelerator such a tensor is
  made on the CPU and the next op mixing it with device tensors fails (or copies).

Both see only Python-level torch calls of the code run inside them (the dispatcher
hides a custom op's implementation from an outer mode), so they wrap the device
wrappers themselves, not `torch.ops.cp.*` calls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode


class HostRead(RuntimeError):
    """A data-dependent host read in code that must run without one."""


_HOST_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.Tensor.masked_select,
    torch.masked_select, torch.unique, torch.Tensor.unique, torch.unique_consecutive, torch.argwhere,
    torch.Tensor.argwhere, torch.repeat_interleave, torch.Tensor.repeat_interleave, torch.Tensor.cpu,
}

FACTORIES = (torch.arange, torch.zeros, torch.ones, torch.full, torch.empty, torch.tensor, torch.as_tensor,
             torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye, torch.empty_strided)


def _bool_index(args: tuple[Any, ...]) -> bool:
    index = args[1] if len(args) > 1 else None
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


class HostReadMode(TorchFunctionMode):
    """Raise `HostRead` on any host read of tensor data inside the block (see module doc)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in _HOST_READS:
            raise HostRead(f"host read {name}() in a device path: a CUDA graph / aclgraph cannot capture it; "
                           "keep the value on the device (torch ops, or inside the kernel)")
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _bool_index(args):
            raise HostRead(f"boolean-mask indexing ({name}) in a device path: its size is data-dependent (a host "
                           "sync); use torch.where or a masked kernel")
        return func(*args, **kwargs)


class FactoryDeviceMode(TorchFunctionMode):
    """Record (in `.missing`) every tensor factory called without `device=`."""

    def __init__(self) -> None:
        super().__init__()
        self.missing: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            self.missing.append(f"torch.{func.__name__}{tuple(a if not isinstance(a, torch.Tensor) else 'T' for a in args)}")
        return func(*args, **kwargs)


__all__ = ["FACTORIES", "FactoryDeviceMode", "HostRead", "HostReadMode"]
