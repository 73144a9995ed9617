"""The accelerator kernels of `cp::mla_preprocess` / `cp::mla_preprocess_quant` (their `OpDecl.cuda`):
`mla_preprocess_device` / `mla_preprocess_quant_device` of `triton_tail.py`, fetched (and triton imported) on first call (`core/launcher.lazy`):
registration imports no triton."""

from __future__ import annotations
from cp_compile.ops.core.launcher import lazy

mla_preprocess = lazy("cp_compile.ops.mla_preprocess.triton_tail", "mla_preprocess_device")
mla_preprocess_quant = lazy("cp_compile.ops.mla_preprocess.triton_tail", "mla_preprocess_quant_device")
