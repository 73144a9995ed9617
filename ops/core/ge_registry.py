"""GE converters for every `cp::*` op (torchair `max-autotune`, NPU graph mode).

Converter functions `convert_<op>`, registered from the op declarations
(`OpDecl.ge`, ops/spec.py) by `register_converters()`. One module per op family: `cache` (metadata localisation, cache writes),
`attention` (paged attention with LSE, single-device GQA / MLA),
`merge` (LSE merges), `sparse` (lightning indexer, sparse MLA, the SFA DCP ops), `dsa_cp`
(the DSA-CP token-shard indexer and sparse MLA), `quant` (the W8A8 linears), `mla_preprocess`
(MLAPO, primitives: why not CANN's MlaProlog is in its docstring). The mapping of each
op to CANN operators, and why, is in docs/torchair.md and each module's docstring.

Importing this package imports no torchair; `register_converters()` does, lazily
(torchair exists only with torch-npu). The `_c10d_functional` collectives use
torchair's own converters (HcomAllGather / HcomReduceScatter / HcomAllToAllV,
group from the process group's tag and rank list); `python -m
tools.ge_check` checks them.
"""

from __future__ import annotations

import importlib

import torch

from cp_compile.ops.catalog import OPS, ge_ops
from cp_compile.ops.spec import GE

# Every cp:: op with a converter -> the GE op types its converted graph contains (from
# the op declarations; the GE check compares this with the ops registered in the `cp`
# namespace and with what the converted graphs contain).
GE_OPS = ge_ops()
MODULES = tuple(sorted({d.ge.module for d in OPS if isinstance(d.ge, GE)}))
# Converters of aten ops that replace torchair's (each module's `register()`):
# aten.constant_pad_nd of a symbolic amount (the DSA-CP token pad).
ATEN_MODULES = ("aten_pad",)

_registered: list[str] = []


def register_converters() -> list[str]:
    """Register every declared converter with torchair (`convert_<op>` of
    `cp_compile.ops.ge.<module>`, ops/spec.py); idempotent. Raises ImportError when
    torchair is not importable."""
    import torchair  # optional: exists only with torch-npu

    if _registered:
        return sorted(_registered)
    for decl in OPS:
        if not isinstance(decl.ge, GE):
            continue
        module = importlib.import_module(f"{__name__}.{decl.ge.module}")
        op = getattr(torch.ops.cp, decl.name.split("::", 1)[1]).default
        torchair.register_fx_node_ge_converter(op)(getattr(module, GE.converter(decl.name)))
        _registered.append(decl.name)
    for name in ATEN_MODULES:  # imported like the converter modules (they import torchair)
        importlib.import_module(f"{__name__}.{name}").register()
    return sorted(_registered)
