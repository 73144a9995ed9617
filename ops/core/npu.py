"""torch_npu, imported where a kernel runs, never at op registration: torch_npu exists
only on Ascend machines (with CANN), and the NPU kernels of every family
(`paged/npu.py`, `merge/npu.py`) fetch it here, so the tests' stand-in
(`sys.modules["torch_npu"]`, tests/ops/test_npu_fused_kernels.py) reaches all of them."""

from __future__ import annotations

from types import ModuleType


def torch_npu() -> ModuleType:
    """The torch_npu module (ImportError without it)."""
    import torch_npu  # noqa: F401  (optional: Ascend only)

    return torch_npu
