"""The LSE merges as custom ops (docs/architecture.md §5): the two ways DCP combines the
partial attentions (out, lse) of its ranks, and chunked prefill its context and new-token
parts. -inf partials (empty shards) weigh 0; a NaN LSE makes the row NaN (decision 47).

Collectives are *not* inside these ops: the compositions in
`cp_compile.ops.parallel.dcp` issue them as `_c10d_functional` ops so they stay
visible graph nodes. CPU runs the torch references (`reference.py`); CUDA (and NPU when
torch_npu is present) the Triton kernels (`launch.py`, `triton_merge.py`), or on the
NPU torch_npu's fused op for `cp::lse_combine` (`npu.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cp_compile.ops.core.spec import GE, TRITON_ASCEND, OpDecl
from cp_compile.ops.merge import launch, npu, reference


@torch.library.custom_op("cp::lse_rescale", mutates_args=())
def lse_rescale(out: Tensor, lse: Tensor, lse_all: Tensor) -> tuple[Tensor, Tensor]:
    """AG+RS merge, local half: weight this rank's partial by exp(lse - LSE).

    out [T,G,Dv], lse [T,G] fp32 (this rank's partial), lse_all [N*G, T] fp32 (the
    all-gathered head-major partial LSEs of the N ranks). Returns the rescaled
    partial [T,G,Dv] fp32 (summing it over ranks gives the exact result) and the
    merged LSE [T,G]. Empty shards (lse -inf) weigh 0; all-empty rows give 0, never NaN;
    a NaN LSE on any rank makes the row NaN (strict, decision 47).
    """
    T, G = lse.shape
    parts = lse_all.view(-1, G, T).permute(0, 2, 1).float()  # [N, T, G]
    total = reference.merged_lse(parts)  # [T, G]; -inf when every shard is empty, NaN if one is NaN
    mine = lse.float()
    empty = mine == float("-inf")  # own shard empty (so is an all-empty row): weight 0, out not read
    w = torch.where(empty, torch.zeros_like(mine), torch.exp(mine - total))  # NaN / +inf LSEs propagate
    scaled = torch.where(empty[..., None], torch.zeros((), dtype=torch.float32, device=out.device),
                         out.float() * w[..., None])
    # Contiguous, as the fake kernel says: elementwise results keep a strided `out`'s layout
    # (a head-permuted partial), which Inductor's assert_size_stride refused (PCP at dcp 2).
    return scaled.contiguous(), total.contiguous()


@lse_rescale.register_fake
def _(out, lse, lse_all):
    return out.new_empty(out.shape, dtype=torch.float32), lse.new_empty(lse.shape, dtype=torch.float32)


@torch.library.custom_op("cp::lse_combine", mutates_args=())
def lse_combine(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge N partials of the same queries: outs [N, ..., Dv], lses [N, ...] ->
    (out [..., Dv] fp32, lse [...] fp32). Used after the all-to-all, and to combine
    the context and new-token parts of chunked prefill. -inf partials weigh 0, NaN
    propagates (`reference.merge_partials`, decision 47)."""
    merged = reference.merge_partials(outs, lses)
    return merged, reference.merged_lse(lses)


@lse_combine.register_fake
def _(outs, lses):
    return outs.new_empty(outs.shape[1:], dtype=torch.float32), lses.new_empty(lses.shape[1:], dtype=torch.float32)



# ----------------------------------------------------------------------------- declarations (core/spec.py)
# Every piece of every op above: kernels per device, GE converter, profile bucket.
OPS = (
    OpDecl(lse_rescale, cuda=launch.lse_rescale, npu=TRITON_ASCEND,
           ge=GE("ge", "ReduceMaxD", "Exp", "Log", "SelectV2"), profile="dcp_local"),
    OpDecl(lse_combine, cuda=launch.lse_combine, npu=npu._lse_combine,
           ge=GE("ge", "AttentionUpdate"), profile="dcp_local"),
)
