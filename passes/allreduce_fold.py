"""The all-reduce fold (issue 37, decision 62): the DCP output merge folded into the TP
all-reduce after o_proj.

The merge is `out = sum_r w_r * out_r` (`w_r = exp(lse_r - LSE)` per token and head), and
what reads it is linear up to a sum that the TP all-reduce already does: (MLA: W_UV per
head,) the `[T, H*Dv]` reshape and the row-parallel o_proj `y = x @ W_o^T` (this rank's
columns of o_proj: its heads), then `all_reduce(y, "sum", tp)`. So instead of merging,
every rank of the DCP group weights its own partial of the group's N*H heads by `w_r`
(`dcp.rescale_partial`: the LSE all-gather and `cp::lse_rescale`, AG+RS's first half),
(MLA: projects it by the group's W_UV,) multiplies it by the o_proj columns of the group's
heads (`[hidden, N*H*Dv]`, gathered once at compile time over the group) and hands it to the
TP all-reduce, which now sums over the DCP group's ranks as well as over the heads of every
TP rank. The output collective of the merge (AG+RS's reduce-scatter, the all-to-all) is gone;
each rank runs its o_proj on N x the heads and holds (N - 1) x its o_proj shard more weights.

Proven by passes/fold_match.py (`find_fold`); the refusals are the DCP pass's decision
(`PassRecord.decision["not_foldable"]`; `dcp_merge_fold="on"` raises them).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from cp_compile.ops.parallel import dcp as dcp_compose
from cp_compile.passes.base import CPPass
from cp_compile.passes.context import CompileContext
from cp_compile.passes.dcp_attention import DCPAttentionPass
from cp_compile.passes.fold_match import find_fold
from cp_compile.passes.fx_utils import ShapedProxy
from cp_compile.passes.project_before_merge import _erase_old_merge
from cp_compile.passes.projection_match import MERGE_SITE_KEY
from cp_compile.passes.query_replication import constant_buffer, parameter_value


class AllReduceFoldPass(CPPass):
    """Fold each marked DCP merge into the TP all-reduce after the row-parallel o_proj."""

    name = "allreduce_fold"
    enabled_when = ("the dcp_attention pass runs, dcp_merge_fold is not 'off' and the context has the cp group's "
                    "collectives (init_parallel) to gather the o_proj columns over; it rewrites the merges its "
                    "decision marked for the fold")

    def __init__(self, ctx: CompileContext) -> None:
        super().__init__(ctx)
        self.decision: dict | None = None

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        return (ctx.config.dcp_merge_fold != "off" and ctx.cp_collectives is not None
                and DCPAttentionPass.is_enabled(ctx))

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        marked = [(n, n.meta[MERGE_SITE_KEY]) for n in graph.nodes
                  if MERGE_SITE_KEY in n.meta and n.meta[MERGE_SITE_KEY].fold]
        self.decision = {"folded": 0, "gathered_o_proj_bytes": 0, "gathered_projection_bytes": 0}
        if not marked:
            self.decision["reason"] = "no merge marked for the fold (see the dcp_attention decision)"
            return 0
        group = self.ctx.cp_collectives
        tracer = fx.proxy.GraphAppendingTracer(graph)
        for merged, site in marked:
            fold = find_fold(merged, site.heads, self.ctx.tp.name, site.latent)
            if isinstance(fold, str):  # the DCP pass proved it on the same readers; a later pass changed them
                raise RuntimeError(f"allreduce_fold: {fold}")
            o_parts = group.all_gather(parameter_value(fold.weight))  # [hidden, H*Dv] each, group rank order
            self.decision["gathered_o_proj_bytes"] += sum(p.numel() * p.element_size() for p in o_parts[1:])
            with graph.inserting_before(fold.linear):
                w_o = constant_buffer(gm, f"_cp_fold_o_{merged.name}", torch.cat(o_parts, dim=1),  # [hidden, N*H*Dv]
                                      static_shapes=True)
                w_uv = None
                if fold.projection is not None:
                    proj = fold.projection
                    parts = [proj.weight_of(p).contiguous() for p in group.all_gather(parameter_value(proj.parameter))]
                    self.decision["gathered_projection_bytes"] += sum(p.numel() * p.element_size() for p in parts[1:])
                    w_uv = constant_buffer(gm, f"_cp_fold_uv_{merged.name}", torch.cat(parts, dim=proj.head_axis),
                                           static_shapes=True)
                part = dcp_compose.Partial(ShapedProxy(site.out, tracer), ShapedProxy(site.lse, tracer), site.heads,
                                           site.dtype)
                scaled = dcp_compose.rescale_partial(part, site.ctx)  # [T, N*H, Dv] (MLA: L)
                if w_uv is not None:
                    scaled = torch.einsum(fold.projection.equation, scaled, ShapedProxy(w_uv, tracer))
                y = torch.nn.functional.linear(scaled.flatten(1), ShapedProxy(w_o, tracer))  # [T, hidden]
                for _ in range(fold.leading_ones):  # o_proj's input was [1, ..., 1, T, H*Dv]
                    y = y.unsqueeze(0)
            fold.linear.replace_all_uses_with(y.node)
            for n in (fold.linear, *reversed(fold.reshapes)) + ((fold.projection.user,) if fold.projection else ()):
                graph.erase_node(n)
            _erase_old_merge(graph, merged, site)
            self.decision["folded"] += 1
        graph.lint()
        gm.recompile()
        return len(marked)


__all__ = ["AllReduceFoldPass"]
