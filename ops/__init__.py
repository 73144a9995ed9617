"""Custom ops of cp-compile (installed as `cp_compile.ops`).

Importing this package registers every `cp::*` op with torch.library:
single-device attention ops (`attention`), the DCP building blocks (`dcp`) and the
DSA-CP token-shard blocks (`dsa_cp`), the W8A8 linears (`quant`), with
their torch references (`reference`), layout math (`layout`) and kernels
(`kernels`). The parallel compositions built from these ops live in
`cp_compile.parallel`; the graph rewrites that place them, in `cp_compile.passes`.
"""

from cp_compile.ops import attention, dcp, dsa_cp, layout, quant, reference  # noqa: F401
from cp_compile.ops.kernels.registry import register_device_kernels

register_device_kernels()
