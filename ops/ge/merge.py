"""GE converters: the two LSE merges.

- `cp::lse_combine` (after the all-to-all; chunked-prefill combine) -> CANN's
  `AttentionUpdate` (torch_npu `npu_attention_update`, the op vLLM-Ascend's DCP
  decode merges partials with), through the generated builder
  `ge.AttentionUpdate(lse=[N x [M]], go=[N x [M, Dv]], update_type=1, sp=N)`;
  `update_type=1` also returns the merged LSE (`lse_m`), which chunked prefill needs.
  The N partials are split off dim 0 (`SplitD`) and flattened to M rows.
- `cp::lse_rescale` (AG+RS, local half) -> a composition of GE primitives: no
  fused op weights one rank's partial by exp(lse - LSE). The merged LSE is
  max + log(sum(exp(x - max))) with the max made finite first, so an all-empty
  row gives -inf (not NaN), and weights of non-finite rows are 0 (SelectV2), as in
  the reference.
"""

from __future__ import annotations

from typing import Any

from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import Tensor

from cp_compile.ops.ge._util import F32, I64, cast, const, dims, reshape, where


def clean(lse: Tensor) -> Tensor:
    """Any non-finite LSE -> -inf: NaN as reference.clean_lse, and +inf, which CANN's FIA
    page calls "invalid" LSE data (what FIA gives for a row without keys is not documented)."""
    return where(ge.IsFinite(lse), lse, const(float("-inf"), F32))


# A finite stand-in for -inf in AttentionUpdate's inputs: its page gives the formula only,
# which is NaN for a row whose every LSE is -inf (a token no rank holds keys for).
LSE_FLOOR = -1.0e30


def convert_lse_rescale(out: Tensor, lse: Tensor, lse_all: Tensor, meta_outputs: Any = None):
    T, G = dims(lse)
    NG = int(lse_all.meta.shape[0])
    n = NG // int(G)
    parts = ge.TransposeD(reshape(lse_all, [n, G, T]), perm=[0, 2, 1])  # [N, T, G]
    parts = clean(cast(parts, F32))
    m = ge.ReduceMaxD(parts, axes=[0], keep_dims=True)
    m = where(ge.IsFinite(m), m, const(0.0, F32))
    total = ge.Add(ge.Log(ge.ReduceSumD(ge.Exp(ge.Sub(parts, m)), axes=[0], keep_dims=True)), m)
    total = ge.SqueezeV2(total, axis=[0])  # [T, G]
    mine = clean(cast(lse, F32))
    keep = ge.LogicalAnd(ge.IsFinite(total), ge.IsFinite(mine))
    w = where(keep, ge.Exp(ge.Sub(mine, total)), const(0.0, F32))
    scaled = where(ge.Unsqueeze(keep, axes=[2]), ge.Mul(cast(out, F32), ge.Unsqueeze(w, axes=[2])), const(0.0, F32))
    return scaled, total


def convert_lse_combine(outs: Tensor, lses: Tensor, meta_outputs: Any = None):
    n = int(outs.meta.shape[0])
    dv = int(outs.meta.shape[-1])
    go = [reshape(x, [-1, dv]) for x in ge.SplitD(outs, split_dim=0, num_split=n)]
    cleaned = clean(cast(lses, F32))  # [N, ...]
    empty = ge.LogicalNot(ge.ReduceAny(ge.IsFinite(cleaned), const([0], I64), keep_dims=False))  # [...]
    floored = ge.Maximum(cleaned, const(LSE_FLOOR, F32))
    lse = [reshape(x, [-1]) for x in ge.SplitD(floored, split_dim=0, num_split=n)]
    merged, lse_m = ge.AttentionUpdate(lse, go, update_type=1, sp=n)
    # Rows no rank has keys for: out 0, LSE -inf (as the reference), whatever the op does there.
    out = where(ge.Unsqueeze(empty, axes=[-1]), const(0.0, F32), reshape(cast(merged, F32), dims(outs)[1:]))
    return out, where(empty, const(float("-inf"), F32), reshape(lse_m, dims(lses)[1:]))

