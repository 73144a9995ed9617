"""PCP's one op: `cp::pcp_token_index`, the marker of a prefill graph's token indices (issue 20).

At pcp > 1 the compiled entry (`decorator.CompiledForward`) compiles prefill steps
through a wrapper that takes this rank's token indices ([T_loc] int64, -1 padded:
a row of `core/pcp_layout.pcp_token_table`) and calls this op on them before anything
else. The `pcp_attention` pass finds the token indices as the argument of this op's
one call, whatever the wrapper's parameter is named (no name is matched against
Dynamo's sources), and removes the call. So the op is an identity (a copy: a custom
op may not return an alias of its input) that never reaches a lowering: no device
kernel, no GE converter.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cp_compile.ops.core.spec import Absent, OpDecl


@torch.library.custom_op("cp::pcp_token_index", mutates_args=())
def pcp_token_index(index: Tensor) -> Tensor:
    """index [T_loc] int64 -> the same values: marks them as this rank's token indices."""
    return index.clone()


@pcp_token_index.register_fake
def _(index):
    return torch.empty_like(index)


_REMOVED = "a graph marker: the pcp_attention pass removes its one call before any lowering"

OPS = (
    OpDecl(pcp_token_index, cuda=Absent(_REMOVED), npu=Absent(_REMOVED), ge=Absent(_REMOVED), profile="other"),
)
