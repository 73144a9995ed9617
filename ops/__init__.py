"""Custom ops of cp-compile (installed as `cp_compile.ops`).

Importing this package registers every `cp::*` op with torch.library:
single-device attention ops (`attention`), DCP building blocks (`dcp`) and their
compositions (`dcp_attention`).
"""

from cp_compile.ops import attention, dcp, dcp_attention, layout, reference  # noqa: F401
from cp_compile.ops.kernels.registry import register_device_kernels

register_device_kernels()
