"""The accelerator kernels of the W8A8 linears (their `OpDecl.cuda`): the `*_device`
functions of `triton_int8_matmul.py`, fetched (and triton imported) on first call
(`core/launcher.lazy`): registration imports no triton."""

from __future__ import annotations
from cp_compile.ops.core.launcher import lazy

_INT8_MATMUL = "cp_compile.ops.quant.triton_int8_matmul"

w8a8_dynamic_linear = lazy(_INT8_MATMUL, "w8a8_dynamic_linear_device")
w8a8_static_linear = lazy(_INT8_MATMUL, "w8a8_static_linear_device")
