"""GE converters of the merge family: the two LSE merges.

- `cp::lse_combine` (after the all-to-all; chunked-prefill combine) -> CANN's
  `AttentionUpdate` (torch_npu `npu_attention_update`, the op vLLM-Ascend's DCP
  decode merges partials with), through the generated builder
  `ge.AttentionUpdate(lse=[N x [M]], go=[N x [M, Dv]], update_type=1, sp=N)`;
  `update_type=1` also returns the merged LSE (`lse_m`), which chunked prefill needs.
  The N partials are split off dim 0 (`SplitD`) and flattened to M rows.
- `cp::lse_rescale` (AG+RS, local half) -> a composition of GE primitives: no
  fused op weights one rank's partial by exp(lse - LSE). The merged LSE is
  max + log(sum(exp(x - max))) with the max made finite first, so an all-empty
  row gives -inf (not NaN), and weights of empty (-inf) rows are 0 (SelectV2), as in
  the reference.
Strict as the reference (decision 47): only -inf is empty; a NaN or +inf LSE makes
its row NaN, selected explicitly (not left to how ReduceMax / AttentionUpdate treat
NaN on the device). FIA's +inf reading of a row without keys (docs/torchair.md) is
mapped to -inf where FIA's LSE enters (`paged/ge.fia_lse`), not here.
"""

from __future__ import annotations

from typing import Any

from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import Tensor

from cp_compile.ops.core.ge_util import F32, I64, cast, const, dims, reshape, where


def invalid(lse: Tensor) -> Tensor:
    """NaN or +inf: no valid partial's LSE (an empty one is -inf)."""
    return ge.LogicalNot(ge.LogicalOr(ge.IsFinite(lse), ge.Equal(lse, const(float("-inf"), F32))))


NAN = float("nan")


# A finite stand-in for -inf in AttentionUpdate's inputs: its page gives the formula only,
# which is NaN for a row whose every LSE is -inf (a token no rank holds keys for).
LSE_FLOOR = -1.0e30


def convert_lse_rescale(out: Tensor, lse: Tensor, lse_all: Tensor, meta_outputs: Any = None):
    T, G = dims(lse)
    NG = int(lse_all.meta.shape[0])
    n = NG // int(G)
    parts = ge.TransposeD(reshape(lse_all, [n, G, T]), perm=[0, 2, 1])  # [N, T, G]
    parts = cast(parts, F32)
    bad = ge.ReduceAny(invalid(parts), const([0], I64), keep_dims=False)  # [T, G]
    m = ge.ReduceMaxD(parts, axes=[0], keep_dims=True)
    m = where(ge.IsFinite(m), m, const(0.0, F32))
    total = ge.Add(ge.Log(ge.ReduceSumD(ge.Exp(ge.Sub(parts, m)), axes=[0], keep_dims=True)), m)
    total = where(bad, const(NAN, F32), ge.SqueezeV2(total, axis=[0]))  # [T, G]
    mine = cast(lse, F32)
    empty = ge.Equal(mine, const(float("-inf"), F32))  # own shard empty (so is an all-empty row)
    w = where(empty, const(0.0, F32), ge.Exp(ge.Sub(mine, total)))
    scaled = where(ge.Unsqueeze(empty, axes=[2]), const(0.0, F32), ge.Mul(cast(out, F32), ge.Unsqueeze(w, axes=[2])))
    poison = ge.LogicalAnd(ge.LogicalNot(empty), bad)
    return where(ge.Unsqueeze(poison, axes=[2]), const(NAN, F32), scaled), total


def convert_lse_combine(outs: Tensor, lses: Tensor, meta_outputs: Any = None):
    n = int(outs.meta.shape[0])
    dv = int(outs.meta.shape[-1])
    go = [reshape(x, [-1, dv]) for x in ge.SplitD(outs, split_dim=0, num_split=n)]
    lses = cast(lses, F32)  # [N, ...]
    axis0 = const([0], I64)
    empty = ge.LogicalNot(ge.ReduceAny(ge.LogicalNot(ge.Equal(lses, const(float("-inf"), F32))), axis0,
                                       keep_dims=False))  # [...]: every partial -inf
    bad = ge.ReduceAny(invalid(lses), axis0, keep_dims=False)  # [...]: some partial NaN / +inf
    # AttentionUpdate gets finite LSEs only (an invalid row is overwritten below).
    floored = where(ge.IsFinite(lses), lses, const(LSE_FLOOR, F32))
    lse = [reshape(x, [-1]) for x in ge.SplitD(floored, split_dim=0, num_split=n)]
    merged, lse_m = ge.AttentionUpdate(lse, go, update_type=1, sp=n)
    # Rows no rank has keys for: out 0, LSE -inf (as the reference), whatever the op does there.
    out = where(ge.Unsqueeze(empty, axes=[-1]), const(0.0, F32), reshape(cast(merged, F32), dims(outs)[1:]))
    out = where(ge.Unsqueeze(bad, axes=[-1]), const(NAN, F32), out)
    lse_m = where(empty, const(float("-inf"), F32), reshape(lse_m, dims(lses)[1:]))
    return out, where(bad, const(NAN, F32), lse_m)
