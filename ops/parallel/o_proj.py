"""DSA-CP o_proj path: the full-weight o_proj on this rank's tokens (docs/dsa_cp.md, "o_proj path").

Under plain TP the o_proj is row-parallel: rank r holds input columns
[r*k, (r+1)*k) (k = in / tp) of the weight, multiplies its slice of the
attention output for all T tokens and the partial sums are all-reduced:

    y = all_reduce_sum(x[T, k] @ W_r^T)                         [T, out] on every rank

For prefill / mixed batches under DSA-CP the same layer runs full-weight on a token
shard instead (rows = ceil(T / tp), rank r owns padded rows [r*rows, (r+1)*rows)):

    W_full  = all_gather(W_r)              the TP-sharded weight and every input-sharded
                                           quantisation parameter, gathered along the
                                           input-shard dim (a graph intermediate)
    x_rows  = all_to_all(x)                [T, k] -> [rows, tp*k]: scatter tokens, gather
                                           input features (TP rank order = feature order)
    y_rows  = x_rows @ W_full^T            [rows, out]: complete sums, no reduction
    y       = all_gather(y_rows)[:T]       [T_pad, out] -> [T, out] on every rank

which replaces the partial matmul + all-reduce. Per-output-channel parameters
(dynamic W8A8 weight scale / offset) are the same on every rank and are not
gathered. Quantised linears keep the TP arithmetic exactly: activations are
quantised per input group with groups = tp (each group is one former shard), so
every int32 accumulator equals the rank's (ops/quant/reference.py).

Traceable like `parallel/dsa_cp.py` (functional collectives, each followed by
`wait_tensor`, no data-dependent control flow); the graph pass
(`passes/o_proj_dsa_cp.py`) calls these on FX proxies and eager code
(`cp_compile.runtime.o_proj_full_weight`) calls the same token-shard functions on tensors.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

import cp_compile.ops.quant.ops  # noqa: F401  (registers cp::w8a8_*_linear)
from cp_compile.ops.parallel.dsa_cp import DSACPContext, pad_tokens, shard_rows

_c10d = torch.ops._c10d_functional
_cp = torch.ops.cp

LinearKind = Literal["linear", "w8a8_dynamic", "w8a8_static"]

# Which arguments of each linear are split along the input dim on a TP rank (and
# therefore gathered for the full-weight o_proj), with the dim they are split on.
# The unquantised F.linear weight is [out, in/tp]: split on dim 1; it is gathered
# as its transpose (dim 0). The int8 weights are K-major [in/tp, out]; static
# W8A8's activation scale / offset [G], quant bias and dequant scale [G, out] are
# per input group. Everything not listed is per output channel (kept as it is).
INPUT_SHARDED: dict[str, tuple[tuple[str, int], ...]] = {
    "linear": (("weight", 1),),
    "w8a8_dynamic": (("weight", 0),),
    "w8a8_static": (("weight", 0), ("input_scale", 0), ("input_offset", 0), ("quant_bias", 0), ("deq_scale", 0)),
}


def all_gather_dim0(t: Tensor, ctx: DSACPContext) -> Tensor:
    """[d0, ...] on each rank -> [tp * d0, ...] in TP rank order."""
    g = _c10d.all_gather_into_tensor.default(t.contiguous(), ctx.tp.size, ctx.tp.name)
    return _c10d.wait_tensor.default(g)


def shard_tokens(x: Tensor, ctx: DSACPContext) -> Tensor:
    """All-to-all: [T, k] (my input features, all tokens) -> [rows, tp * k] (all features, my rows).

    Rank j receives chunk j of the padded tokens; what comes back from rank j is
    rank j's features of my rows, so features arrive in rank order (the model's).
    Only x's own shape is read (T may be symbolic; the pass traces this on proxies
    whose symbolic sizes are `sym_size` nodes). The pad is `F.pad` (`pad_tokens`):
    a concatenation of zero rows would make Dynamo guard on the pad being 0.
    """
    rows = shard_rows(x.shape[0], ctx)  # ceil(T / tp)
    xp = pad_tokens(x, ctx).contiguous()  # [T_pad, k]
    splits = [rows] * ctx.tp.size
    recv = _c10d.all_to_all_single.default(xp, splits, splits, ctx.tp.name)
    recv = _c10d.wait_tensor.default(recv)  # [tp * rows, k]: chunk j = rank j's features of my rows
    # The tp token chunks side by side on the feature dim. No view of the symbolic token
    # dim: splitting tp * rows with a view makes the tracer guard rows != 1, and the
    # graph would recompile for steps with T <= tp.
    return torch.cat(recv.tensor_split(ctx.tp.size, dim=0), dim=1)  # [rows, tp * k]


def gather_tokens(y_rows: Tensor, ctx: DSACPContext, num_tokens: int) -> Tensor:
    """[rows, out] (my rows, complete; a fresh matmul output, so contiguous) -> [T, out]
    (every token, on every rank). No `.contiguous()` here: on a symbolic rows dim it
    makes the tracer guard rows != 1 (a recompile for steps with T <= tp)."""
    g = _c10d.all_gather_into_tensor.default(y_rows, ctx.tp.size, ctx.tp.name)
    return _c10d.wait_tensor.default(g)[:num_tokens]


def full_linear(kind: LinearKind, x_rows: Tensor, params: dict[str, Tensor], groups: int) -> Tensor:
    """The o_proj on full weights: x_rows [rows, in] -> [rows, out] (complete sums).

    params: the full (gathered) input-sharded tensors and the per-output ones. For
    "linear", params["weight_t"] is W_full^T [in, out]; groups: activation groups
    of the quantised linears (tp * the rank's own).
    """
    if kind == "linear":
        return torch.mm(x_rows, params["weight_t"])
    if kind == "w8a8_dynamic":
        return _cp.w8a8_dynamic_linear.default(x_rows, params["weight"], params["weight_scale"],
                                               params["weight_offset"], groups)
    if kind == "w8a8_static":
        return _cp.w8a8_static_linear.default(x_rows, params["weight"], params["input_scale"],
                                              params["input_offset"], params["quant_bias"], params["deq_scale"])
    raise ValueError(f"full_linear: kind {kind!r} is not one of {list(INPUT_SHARDED)}")


def o_proj_full_weight(kind: LinearKind, x: Tensor, params: dict[str, Tensor], ctx: DSACPContext,
                       groups: int = 1) -> Tensor:
    """The row-parallel o_proj's result ([T, out], the value after its all-reduce),
    computed full-weight on this rank's token shard.

    x [T, in/tp]: this rank's input features of every token (the TP layout);
    params: the rank's TP parameters as the row-parallel linear takes them
    (F.linear: weight [out, in/tp]; W8A8: see `ops/quant/ops.py`); groups: the rank's
    own activation groups (quantised linears).
    """
    full = dict(params)
    for name, dim in INPUT_SHARDED[kind]:
        t = params[name]
        if kind == "linear":
            # [out, in/tp] -> transposed shard [in/tp, out] (a shard-sized transient)
            # -> gathered W_full^T [in, out]: no full-size transposed copy.
            full["weight_t"] = all_gather_dim0(t.t(), ctx)
            del full["weight"]
        else:
            full[name] = all_gather_dim0(t, ctx)  # [tp * d0, ...]
    y_rows = full_linear(kind, shard_tokens(x, ctx), full, groups * ctx.tp.size)  # [rows, out]
    return gather_tokens(y_rows, ctx, x.shape[0])


def o_proj_bytes_per_step(num_tokens: int, in_features: int, out_features: int, tp: int, act_bytes: int,
                          sharded_param_bytes: int) -> dict[str, int]:
    """Bytes one rank sends per o_proj layer and step (the CollectiveMeter conventions).

    row-parallel all-reduce (ring): 2 (tp-1)/tp * T * out * b.
    Full-weight path: parameter all-gathers (tp-1) * P (P = bytes of this rank's
    input-sharded parameters: out * in/tp * wb for the weight, plus static W8A8's
    group parameters), token all-to-all (tp-1)/tp * T_pad * in/tp * b, output
    all-gather (tp-1) * rows * out * b.
    """
    rows = -(-num_tokens // tp)
    t_pad = rows * tp
    k = in_features // tp
    weight = (tp - 1) * sharded_param_bytes
    a2a = (tp - 1) * t_pad * k * act_bytes // tp
    ag = (tp - 1) * rows * out_features * act_bytes
    return dict(all_reduce=2 * (tp - 1) * num_tokens * out_features * act_bytes // tp, weight_gather=weight,
                token_all_to_all=a2a, output_all_gather=ag, full_weight_total=weight + a2a + ag)
