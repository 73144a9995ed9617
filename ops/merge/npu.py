"""NPU eager kernel of `cp::lse_combine` from torch_npu's fused op, for aclgraph capture
(torchair `reduce-overhead`): `npu_attention_update(lses, outs, update_type=1)`, the
CANN op the family's GE converter (`ge.py`) emits, so eager, aclgraph and GE graph
mode run one kernel.

Not run on an NPU (none here; torch_npu cannot import without CANN):
tests/ops/test_npu_fused_kernels.py runs it against a torch_npu stand-in. Declared as
the op's `npu` kernel in `ops.py`; `core/registry.py` registers it when torch_npu imports.

aclgraph capture (issue 21): it reads nothing on the host. AttentionUpdate never sees
an all -inf row (its page gives only the formula, NaN there): LSEs are floored, and
empty rows set to 0 / -inf.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core.npu import torch_npu as _torch_npu

# A finite floor for AttentionUpdate's LSEs (see the module doc).
LSE_FLOOR = -1.0e30


def _lse_combine(outs, lses):
    n, dv = outs.shape[0], outs.shape[-1]
    lses = lses.float()
    finite = torch.isfinite(lses)
    empty = (lses == float("-inf")).all(dim=0)  # no rank holds a key for this row
    bad = (torch.isnan(lses) | torch.isposinf(lses)).any(dim=0)  # invalid LSE: the row is NaN (decision 47)
    floored = torch.where(finite, lses, torch.full_like(lses, LSE_FLOOR))  # the op gets finite LSEs only
    merged, total = _torch_npu().npu_attention_update([floored[i].reshape(-1) for i in range(n)],
                                                      [outs[i].reshape(-1, dv) for i in range(n)], 1)
    merged = merged.float().reshape(outs.shape[1:])
    total = total.reshape(lses.shape[1:])
    merged = torch.where(empty[..., None], torch.zeros_like(merged), merged)
    total = torch.where(empty, torch.full_like(total, float("-inf")), total)
    return (torch.where(bad[..., None], torch.full_like(merged, float("nan")), merged),
            torch.where(bad, torch.full_like(total, float("nan")), total))
