"""Registration of the GE converters of every `cp::*` op (torchair `max-autotune`, NPU graph mode).

Converter functions `convert_<op>` live in their op's family folder (`ge.py`, and
`ge_cache.py` / `ge_dsa_cp.py` where a family has two), named by the op
declarations (`OpDecl.ge`, core/spec.py), and are registered by
`register_converters()`. The mapping of each op to CANN operators, and why, is in
docs/torchair.md and each converter module's docstring. Shared helpers:
`core/ge_util.py`; the aten converter (DSA-CP's symbolic token pad):
`core/ge_aten_pad.py`.

Importing this module imports no torchair; `register_converters()` does, lazily
(torchair exists only with torch-npu). The `_c10d_functional` collectives use
torchair's own converters (HcomAllGather / HcomReduceScatter / HcomAllToAllV,
group from the process group's tag and rank list); `python -m
tools.ge_check` checks them.
"""

from __future__ import annotations

import importlib

import torch

from cp_compile.ops.core.catalog import GE_ATEN_MODULES, OPS, ge_converter_modules, ge_ops
from cp_compile.ops.core.spec import GE

# Every cp:: op with a converter -> the GE op types its converted graph contains (from
# the op declarations; the GE check compares this with the ops registered in the `cp`
# namespace and with what the converted graphs contain).
GE_OPS = ge_ops()
# The dotted modules holding declared converters, and the aten converters (catalog).
MODULES = ge_converter_modules()
ATEN_MODULES = GE_ATEN_MODULES

_registered: list[str] = []


def register_converters() -> list[str]:
    """Register every declared converter with torchair (`convert_<op>` of the op's
    `OpDecl.ge_module`, core/spec.py); idempotent. Raises ImportError when torchair is
    not importable."""
    import torchair  # optional: exists only with torch-npu

    if _registered:
        return sorted(_registered)
    for decl in OPS:
        if not isinstance(decl.ge, GE):
            continue
        module = importlib.import_module(decl.ge_module)
        op = getattr(torch.ops.cp, decl.name.split("::", 1)[1]).default
        torchair.register_fx_node_ge_converter(op)(getattr(module, GE.converter(decl.name)))
        _registered.append(decl.name)
    for name in ATEN_MODULES:  # imported like the converter modules (they import torchair)
        importlib.import_module(name).register()
    return sorted(_registered)
