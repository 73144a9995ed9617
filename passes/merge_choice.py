"""`dcp_merge="auto"` resolved per compiled graph: the cost model's choice (issue 26).

The DCP and PCP passes call `resolve_merge` before rewriting: it reads the first
attention node's query (tokens T at the graph's example size, heads per rank, q and
v head dims, dtype), asks `merge_cost.choose` with the collective costs measured at
`init_parallel`, and returns the pass's context with `merge` set, plus the decision
recorded in the pass history (`PassRecord.decision`). An explicit `dcp_merge` is
used as given. The choice is made on sizes only, so every rank of the group (same
graph, same measured costs) makes the same one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.fx as fx

from cp_compile.base import merge_cost
from cp_compile.passes.context import CompileContext
from cp_compile.passes.fx_utils import fake_value


def _hint(size: Any) -> int:
    """A size as an int: its example value when symbolic (dynamic shapes)."""
    if isinstance(size, torch.SymInt):
        hint = size.node.hint
        return int(hint) if hint is not None else 1
    return int(size)


def attention_sizes(gm: fx.GraphModule, patterns: tuple) -> dict[str, int] | None:
    """tokens, heads, q_dim, v_dim, dtype_bytes of the graph's first attention node (None: none)."""
    for node in gm.graph.nodes:
        pattern = next((p for p in patterns if p.matches(node)), None)
        if pattern is None:
            continue
        args = pattern.bind(node)
        if "q" in args:  # GQA: q [T, Hq, D], v [T, Hkv, Dv]
            q, dq, dv = fake_value(args["q"]), None, _hint(fake_value(args["v"]).shape[-1])
        else:  # MLA: q_nope [T, H, L], q_pe [T, H, R]; values are the L latent columns
            q = fake_value(args["q_nope"])
            dv = _hint(q.shape[-1])
            dq = dv + _hint(fake_value(args["q_pe"]).shape[-1])
        return dict(tokens=_hint(q.shape[0]), heads=_hint(q.shape[1]), q_dim=dq or _hint(q.shape[-1]), v_dim=dv,
                    dtype_bytes=q.dtype.itemsize)
    return None


def resolve_merge(ctx: CompileContext, view: Any, gm: fx.GraphModule, patterns: tuple,
                  query_weights: merge_cost.QueryWeights | None = None,
                  not_replicable: str | None = None, *, project: str = "off",
                  projection: merge_cost.ProjectionWeights | None = None,
                  not_projectable: str | None = None, fold: str = "off",
                  fold_weights: merge_cost.FoldWeights | None = None,
                  not_foldable: str | None = None) -> tuple[Any, dict | None]:
    """(`view` with a concrete merge, the decision) for a DCP / PCP pass's context view.

    `query_weights`: the graph's replicable query projection per layer (the DCP pass,
    passes/query_replication.py), making "replicate" a candidate of "auto"; else
    `not_replicable` says why it is not one (recorded in the decision).
    `project` (dcp_project_before_merge; "off" for passes that do not build it) with
    `projection`: the graph's per-head output projection (passes/projection_match.py),
    making each merge "+project" a candidate; else `not_projectable` says why. The
    decision's "project" is True where the graph is to be projected before the merge.
    `fold` (dcp_merge_fold) with `fold_weights`: the graph's row-parallel o_proj after each
    attention (passes/allreduce_fold.py), making "+fold" candidates; else `not_foldable` says
    why. The decision's "fold" is True where the all-reduce fold is to be built."""
    # An explicit merge, and nothing for the cost model to decide (projection / fold off, or
    # "auto" with nothing to project / fold or no measured costs): the merge as given.
    undecided = lambda mode, weights: mode == "off" or mode == "auto" and (  # noqa: E731
        weights is None or ctx.collective_costs is None)
    if view.merge != "auto" and undecided(project, projection) and undecided(fold, fold_weights):
        decision = {"merge": view.merge, "reason": "explicit dcp_merge"}
        if project != "off" and not_projectable is not None:
            decision["not_projectable"] = not_projectable
        if fold != "off" and not_foldable is not None:
            decision["not_foldable"] = not_foldable
        return view, decision
    sizes = attention_sizes(gm, patterns)
    if sizes is None:  # nothing to rewrite: any concrete value will do
        return dataclasses.replace(view, merge="ag_rs" if view.merge == "auto" else view.merge), None
    choice = merge_cost.choose(ctx.collective_costs, **sizes, query_weights=query_weights, projection=projection,
                               merge=view.merge, project=project, fold=fold, fold_weights=fold_weights)
    decision = choice.to_json()
    if view.merge != "auto":
        decision["reason"] = "explicit dcp_merge; " + decision["reason"]
    if query_weights is not None:
        decision["query_weights"] = dataclasses.asdict(query_weights)
    elif not_replicable is not None:
        decision["not_replicable"] = not_replicable
    if projection is not None:
        decision["projection_weights"] = dataclasses.asdict(projection)
    elif not_projectable is not None and project != "off":
        decision["not_projectable"] = not_projectable
    if fold_weights is not None:
        decision["fold_weights"] = dataclasses.asdict(fold_weights)
    elif not_foldable is not None and fold != "off":
        decision["not_foldable"] = not_foldable
    return dataclasses.replace(view, merge=choice.merge), decision
