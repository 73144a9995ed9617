"""Project before the merge, the matcher: is an attention's output provably followed by a
per-head linear map with parameter weights? (issue 37, decision 61)

The DCP merge is linear in each rank's partial: `out = sum_r w_r * out_r` with
`w_r = exp(lse_r - lse)` one scalar per token and head. A map `o[t, h, :] = out[t, h, :] @ W[h]`
(MLA's W_UV: latent L -> V head dim Dv) therefore commutes with it exactly:
`W[h] (sum_r w_r out_r) = sum_r w_r (W[h] out_r)`. Proven here structurally, on the graph:
- the attention output has exactly one reader (nothing else sees the unprojected latent),
- that reader is an einsum of two operands, the output first, whose equation keeps the
  token and head letters, contracts the last dim and adds one new dim (`thl,hlv->thv`,
  any letters, the weight's dims in any order): per head, linear, nothing non-linear
  between;
- the weight is a parameter with a real value in the graph, or a view of one through
  constant-argument re-indexing ops only (view, reshape, slicing, transpose, ...: the HF
  engine slices W_UV out of kv_b_proj.weight), with the attention's head count; the
  parameter is gathered over the group at compile time and the views re-run on every rank's
  value (passes/project_before_merge.py).
Anything else is refused with the reason (a string), which the DCP pass keeps in its
decision (`PassRecord.decision["not_projectable"]`).

`MergeSite`: what the DCP pass leaves on a merged output node (`node.meta[MERGE_SITE_KEY]`)
so the projection pass finds the partial and re-merges it projected.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from cp_compile.ops.parallel.dcp import DCPContext
from cp_compile.passes.fx_utils import fake_value
from cp_compile.passes.query_replication import parameter_value as _real

MERGE_SITE_KEY = "cp_merge_site"
_EINSUM = {torch.einsum, torch.functional.einsum, torch.ops.aten.einsum.default}


@dataclass(frozen=True)
class MergeSite:
    """A DCP merge in the rewritten graph: its partial (out [T, N*H, Dv], lse [T, N*H]),
    this rank's heads, the output dtype, the merge's context, and whether the DCP pass
    decided to project before it (the cost model's or the config's choice) or to fold it into
    the TP all-reduce after o_proj (`fold`, decision 62: passes/allreduce_fold.py); `latent`:
    the partial is MLA's latent (a per-head projection follows it)."""

    out: fx.Node
    lse: fx.Node
    heads: int
    dtype: torch.dtype
    ctx: DCPContext
    project: bool
    fold: bool = False
    latent: bool = True


@dataclass(frozen=True)
class Projection:
    """The per-head linear map reading an attention's output: `einsum(equation, output, weight)`,
    the weight a parameter or a view of one (`views`: the view ops from the parameter to the
    operand, in order; the HF engine slices W_UV out of kv_b_proj.weight)."""

    user: fx.Node  # the einsum node
    weight: fx.Node  # its weight operand
    equation: str
    head_axis: int  # the weight's head dim (where the group's weights are concatenated)
    out_dim: int  # the new per-head dim (MLA: Dv)
    parameter: fx.Node | None = None  # the parameter the weight is a view of (None: the operand itself)
    views: tuple[fx.Node, ...] = ()

    def weight_of(self, param: torch.Tensor) -> torch.Tensor:
        """The operand computed from a (gathered) value of the parameter: the view ops re-run on it."""
        x = param
        for n in self.views:
            args = tuple(x if a is (n.args[0]) else a for a in n.args)
            if n.op == "call_method":
                x = getattr(x, str(n.target))(*args[1:], **n.kwargs)
            else:
                x = n.target(x, *args[1:], **n.kwargs)
        return x


# Ops that only re-index a tensor: a weight computed from a parameter through these alone is a
# view of it, so every rank's operand is the same ops applied to that rank's parameter.
_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "contiguous", "t", "narrow", "select", "unflatten",
                 "flatten", "squeeze", "unsqueeze", "__getitem__"}
_VIEW_FUNCTIONS = {operator.getitem, torch.transpose, torch.reshape, torch.narrow, torch.select, torch.permute,
                   torch.flatten, torch.squeeze, torch.unsqueeze}


def _constant(a: object) -> bool:
    if isinstance(a, (tuple, list)):
        return all(_constant(x) for x in a)
    if isinstance(a, slice):
        return all(_constant(x) for x in (a.start, a.stop, a.step))
    return a is None or isinstance(a, (int, float, bool, type(Ellipsis)))


def _view_chain(weight: fx.Node) -> tuple[fx.Node, tuple[fx.Node, ...]] | None:
    """(parameter, view ops in order) when `weight` is a parameter re-indexed by constant-argument
    view ops only, else None."""
    chain: list[fx.Node] = []
    n = weight
    while _real(n) is None:
        is_view = (n.op == "call_method" and str(n.target) in _VIEW_METHODS) or (
            n.op == "call_function" and n.target in _VIEW_FUNCTIONS)
        if not is_view or not n.args or not isinstance(n.args[0], fx.Node) or n.kwargs:
            return None
        if not all(_constant(a) for a in n.args[1:]):
            return None
        chain.append(n)
        n = n.args[0]
    return n, tuple(reversed(chain))


def _operands(node: fx.Node) -> tuple[str, list] | None:
    if node.kwargs or not node.args or not isinstance(node.args[0], str):
        return None
    ops = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
    return node.args[0], list(ops)


def find_projection(node: fx.Node, heads: int) -> Projection | str:
    """The projection reading `node` (an attention output [T, H, L]), or why there is none provable."""
    users = list(node.users)
    if len(users) != 1:
        return (f"{node.name} has {len(users)} readers ({', '.join(u.name for u in users) or 'none'}); project "
                "before the merge needs the per-head projection to be its only one")
    u = users[0]
    if u.op != "call_function" or u.target not in _EINSUM:
        return (f"{node.name} is read by {u.name} ({u.target}), not a per-head einsum projection with parameter "
                "weights (nothing may come between the attention and the projection)")
    parsed = _operands(u)
    if parsed is None:
        return f"{u.name}: an einsum call this matcher does not read (keyword arguments or no equation string)"
    eq, ops = parsed
    eq = eq.replace(" ", "")
    if len(ops) != 2 or ops[0] is not node or "->" not in eq or "..." in eq:
        return f"{u.name} ({eq}): not einsum(eq, attention_output, weight) with explicit subscripts"
    lhs, out = eq.split("->")
    a, b = lhs.split(",")
    if len(a) != 3 or len(set(a)) != 3:
        return f"{u.name} ({eq}): the attention output's subscripts must be three distinct letters [T, H, L]"
    t, h, lat = a
    new = set(b) - set(a)
    if len(b) != 3 or len(set(b)) != 3 or set(b) != {h, lat} | new or len(new) != 1:
        return (f"{u.name} ({eq}): the weight must be [H, L, Dv] per head (its subscripts: the head, the "
                "contracted latent and one new letter)")
    (v,) = new
    if out != t + h + v:
        return f"{u.name} ({eq}): the output must keep [T, H] and add the new dim ([T, H, Dv])"
    weight = ops[1]
    chain = _view_chain(weight) if isinstance(weight, fx.Node) else None
    if chain is None:
        name = weight.name if isinstance(weight, fx.Node) else repr(weight)
        return (f"{u.name}'s weight {name} is not a parameter (or a view of one) with a real value in the graph "
                "(computed, or a graph input): its other ranks' values cannot be gathered at compile time")
    w = fake_value(weight)
    shape = tuple(w.shape) if w is not None else tuple(_real(weight).shape)
    if int(shape[b.index(h)]) != heads:
        return f"{u.name}'s weight {weight.name} {list(shape)} has {shape[b.index(h)]} heads, the attention {heads}"
    return Projection(u, weight, eq, b.index(h), int(shape[b.index(v)]), chain[0], chain[1])
