"""The accelerator kernels of the LSE merges, with each op's signature (their `OpDecl.cuda`).

Adapters to the Triton launchers of `triton_merge.py`, fetched (and triton imported)
on first call (`core/launcher.lazy`): registration imports no triton.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core.launcher import lazy

_merge_partials = lazy("cp_compile.ops.merge.triton_merge", "merge_partials_triton")
_lse_rescale = lazy("cp_compile.ops.merge.triton_merge", "lse_rescale_triton")


def lse_rescale(out: torch.Tensor, lse: torch.Tensor, lse_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    T, G = lse.shape
    total = lse.new_empty(T, G)
    scaled = _lse_rescale(out, lse, lse_all.view(-1, G, T).permute(0, 2, 1), lse_out=total)
    return scaled, total


def lse_combine(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = lses.new_empty(lses.shape[1:], dtype=torch.float32)
    return _merge_partials(outs, lses, lse_out=total), total
