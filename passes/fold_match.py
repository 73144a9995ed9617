"""The all-reduce fold, the matcher: is an attention's output provably read by a row-parallel
o_proj and its TP all-reduce alone? (issue 37, decision 62; the rewrite: passes/allreduce_fold.py)

Proven structurally on the graph (the DCP pass runs it on the single-device graph before
rewriting, the fold pass again on the merged node): the attention output's only reader is
(MLA: the per-head projection of passes/projection_match.py, then) a chain of reshape / view /
flatten / (un)squeeze / contiguous ops (no transpose: the row-major order is kept) ending in
[1, ..., 1, T, H*Dv] (the HF engine adds a batch dim), whose only reader is `F.linear(x, W)` with a parameter weight
[hidden, H*Dv] and no bias (a bias before the all-reduce would be added by every rank of the
DCP group: N times; one added after the all-reduce, as `RowParallelLinear` does, is untouched),
whose only reader is a sum all-reduce over the TP group, read by its wait alone. Anything else
is refused with the reason (a string), kept in the DCP pass's decision
(`PassRecord.decision["not_foldable"]`); `dcp_merge_fold="on"` raises it as a ConfigError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from cp_compile.ops.quant.ops import QUANT_LINEAR_OPS
from cp_compile.passes.fx_utils import fake_value
from cp_compile.passes.projection_match import Projection, find_projection
from cp_compile.passes.query_replication import parameter_value

_c10d = torch.ops._c10d_functional
_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
# Ops that only regroup a tensor's dims in its row-major element order (no transpose / permute):
# a chain of them from [T, H, Dv] to [1, ..., 1, T, H*Dv] keeps each token's heads and head dim
# contiguous and in order, so the rows it hands o_proj are the flattened [H, Dv] of each token.
_RESHAPE_METHODS = {"reshape", "view", "flatten", "unsqueeze", "squeeze", "contiguous"}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.flatten, torch.unsqueeze, torch.squeeze}


def _is(node: fx.Node, op: torch._ops.OpOverloadPacket) -> bool:
    return node.op == "call_function" and node.target in (op, op.default)


def _only_reader(node: fx.Node) -> fx.Node | str:
    users = list(node.users)
    if len(users) != 1:
        return f"{node.name} has {len(users)} readers ({', '.join(u.name for u in users) or 'none'})"
    return users[0]


def _quantised_o_proj(lin: fx.Node) -> str | None:
    """Why a W8A8 o_proj does not commute with the merge (None: not one). The fold hands o_proj
    each rank's weighted partial `w_r * out_r` instead of their sum; a quantised linear rounds its
    input to int8 first, and rounding is not linear: quant(a + b) != quant(a) + quant(b)."""
    if lin.op != "call_function":
        return None
    for op in QUANT_LINEAR_OPS:
        if lin.target in (op, op.default):
            break
    else:
        return None
    if op is QUANT_LINEAR_OPS[0]:  # cp::w8a8_dynamic_linear
        why = ("its input is quantised per token (scale = max |x| / 127 over the token's row, then rounded to "
               "int8), and that is not linear: quant(sum_r w_r * out_r) != sum_r quant(w_r * out_r) (each rank's "
               "partial has its own per-token scale and rounding)")
    else:  # cp::w8a8_static_linear
        why = ("its input is rounded to int8 at a calibrated scale, and rounding is not linear "
               "(round(a + b) != round(a) + round(b)); its quant_bias would also be added by each of the N ranks")
    return (f"o_proj is {op._qualified_op_name} (W8A8): {why}, so the merge cannot move past it and the fold "
            "would not be exact (only a float F.linear o_proj commutes with the merge)")


@dataclass(frozen=True)
class Fold:
    """The chain the fold replaces: (MLA: W_UV's einsum,) the reshapes, o_proj's linear (its
    weight a parameter), the TP all-reduce and its wait."""

    projection: Projection | None
    reshapes: tuple[fx.Node, ...]  # attention output -> o_proj input, in order
    linear: fx.Node
    weight: fx.Node
    all_reduce: fx.Node
    wait: fx.Node
    leading_ones: int = 0  # unit dims before [T, H*Dv] in o_proj's input (the HF engine's batch dim)


def find_fold(node: fx.Node, heads: int, tp_group: str, projects: bool) -> Fold | str:
    """The fold's chain after `node` (an attention output [T, H, Dv], or MLA's latent [T, H, L]
    when `projects`), or why there is none provable."""
    proj = None
    cur = node
    if projects:
        proj = find_projection(node, heads)
        if isinstance(proj, str):
            return f"{proj} (the fold projects the group's heads by W_UV first)"
        cur = proj.user
    chain: list[fx.Node] = []
    r = _only_reader(cur)
    while not isinstance(r, str) and ((r.op == "call_method" and str(r.target) in _RESHAPE_METHODS) or (
            r.op == "call_function" and r.target in _RESHAPE_FUNCTIONS)):
        chain.append(r)
        r = _only_reader(r)
    if isinstance(r, str):
        return f"{r}; the fold needs the attention output read by the o_proj input's reshape only"
    if not chain:
        return (f"{cur.name} is read by {r.name} ({r.target}), not a reshape to [T, H*Dv] feeding a row-parallel "
                "o_proj (nothing may come between the attention output and o_proj)")
    flat = fake_value(chain[-1])
    head_dim = fake_value(cur).shape[-1] if fake_value(cur) is not None else None
    lead = tuple(flat.shape[:-2]) if flat is not None and flat.dim() >= 2 else None
    if lead is None or head_dim is None or flat.shape[-1] != heads * head_dim or not all(
            isinstance(d, int) and d == 1 for d in lead):
        return (f"{chain[-1].name} {list(flat.shape) if flat is not None else '?'}: the reshapes after {cur.name} do "
                "not end in [1, ..., 1, T, H*Dv] (the o_proj input the fold rebuilds)")
    r, lin = chain[-1], r
    quant = _quantised_o_proj(lin)
    if quant is not None:
        return f"{r.name} is read by {lin.name}: {quant}"
    if lin.op != "call_function" or lin.target not in _LINEARS:
        return f"{r.name} is read by {lin.name} ({lin.target}), not F.linear (a float row-parallel o_proj)"
    args = list(lin.args) + [lin.kwargs.get(k) for k in ("input", "weight", "bias")[len(lin.args):]]
    if args[0] is not r:
        return f"{lin.name}: the reshaped attention output is not its input"
    weight, bias = args[1], (args[2] if len(args) > 2 else None)
    if bias is not None:
        return (f"{lin.name} adds a bias before the TP all-reduce: folded, every rank of the DCP group would add "
                "it (N times too many); a bias added after the all-reduce is fine")
    if not isinstance(weight, fx.Node) or parameter_value(weight) is None:
        return (f"{lin.name}'s weight is not a parameter with a real value in the graph: its other ranks' columns "
                "cannot be gathered at compile time")
    w = parameter_value(weight)
    if w.dim() != 2 or w.shape[1] != flat.shape[-1]:
        return f"{lin.name}'s weight {list(w.shape)} is not [hidden, H*Dv] with H*Dv = {flat.shape[-1]}"
    ar = _only_reader(lin)
    if isinstance(ar, str):
        return f"{ar}; o_proj's output must go straight to the TP all-reduce (nothing in between)"
    if not _is(ar, _c10d.all_reduce):
        return (f"o_proj {lin.name} is read by {ar.name} ({ar.target}) before any TP all-reduce: nothing may come "
                "between o_proj and the all-reduce the fold leaves the merge to")
    if ar.args[1] != "sum" or ar.args[2] != tp_group:
        return f"{ar.name} is not a sum all-reduce over the TP group ({ar.args[1]!r} over {ar.args[2]!r})"
    wait = _only_reader(ar)
    if isinstance(wait, str) or not _is(wait, _c10d.wait_tensor):
        return f"{ar.name}'s result is not read by its wait_tensor alone"
    return Fold(proj, tuple(chain), lin, weight, ar, wait, len(lead))
