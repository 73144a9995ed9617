"""Project before the merge (issue 37, decision 61): MLA's W_UV moved before the DCP merge.

After the DCP rewrite an MLA layer reads: partial attention over the local shard
(out [T, N*H, L] for the group's heads, lse [T, N*H]) -> merge (AG+RS or the all-to-all
of [out | lse]) -> o_lat [T, H, L] -> einsum(o_lat, W_UV [H, L, Dv]) -> [T, H, Dv]. The
merge is linear in each partial, so the projection commutes with it
(passes/projection_match.py proves the pattern); this pass rebuilds each marked merge
(`MergeSite`, left by the DCP pass where its decision says "project") as

    einsum(out, W_UV of the group's N*H heads) [T, N*H, Dv] -> merge -> [T, H, Dv]

and the einsum's readers read that. The merge then moves Dv columns per head instead of
L (MLA R1: 128 against 512, 4x fewer bytes), and each rank projects N*H heads instead of
H. The other group ranks' W_UV are all-gathered once, here, at compile time (the same
compile-time gathering as query replication: every rank of the group compiles the same
graph; `CompileContext.cp_collectives`) and held by the graph as one buffer per layer,
in group rank order (the partial's head order): (N - 1) x this rank's W_UV more memory
per layer, and a snapshot (weights changed after the compile are not seen).

The decision (project or not, and why not) is the DCP pass's (`PassRecord.decision`:
"project", "not_projectable"); this pass records what it rewrote and the bytes it
gathered (`decision["gathered_weight_bytes"]`).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from cp_compile.ops.parallel import dcp as dcp_compose
from cp_compile.passes.base import CPPass
from cp_compile.passes.context import CompileContext
from cp_compile.passes.dcp_attention import DCPAttentionPass
from cp_compile.passes.fx_utils import ShapedProxy, fake_value
from cp_compile.passes.projection_match import MERGE_SITE_KEY, MergeSite, find_projection
from cp_compile.passes.query_replication import _ancestors, _mutates, constant_buffer, parameter_value
from cp_compile.passes.sfa_dcp import SFADCPPass


def _pure(n: fx.Node) -> bool:
    """An op whose only effect is its output (the merge's ops, collectives included; the
    tensor methods the compositions call: transpose, view, to, ...)."""
    if n.op == "call_method":
        return not (str(n.target).endswith("_") and not str(n.target).startswith("__"))
    return n.op == "call_function" and not _mutates(n)


def _erase_old_merge(graph: fx.Graph, merged: fx.Node, site: MergeSite) -> int:
    """Erase the old merge: every node computed from the partial only on the way to `merged`
    (and their readers, e.g. the merged LSE nobody reads) that no one reads any more; never an
    in-place op. Returns the number erased."""
    keep = _ancestors([site.out, site.lse])
    region = _ancestors([merged]) - keep
    stack, closure = list(region), set(region)
    while stack:  # what the old merge's nodes feed (the merged LSE's transposes)
        for u in stack.pop().users:
            if u not in closure:
                closure.add(u)
                stack.append(u)
    erased, changed = 0, True
    while changed:
        changed = False
        for n in reversed(list(graph.nodes)):
            if n in closure and not n.users and _pure(n):
                graph.erase_node(n)
                closure.discard(n)
                erased += 1
                changed = True
    return erased


class ProjectBeforeMergePass(CPPass):
    """Move each marked merge's per-head output projection (MLA's W_UV) before it."""

    name = "project_before_merge"
    enabled_when = ("the dcp_attention or sfa_dcp pass runs, dcp_project_before_merge is not 'off' and the "
                    "context has the cp group's collectives (init_parallel) to gather the weights over; it "
                    "rewrites the merges their decision marked")

    def __init__(self, ctx: CompileContext) -> None:
        super().__init__(ctx)
        self.decision: dict | None = None

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        return ctx.config.dcp_project_before_merge != "off" and ctx.cp_collectives is not None and (
            DCPAttentionPass.is_enabled(ctx) or SFADCPPass.is_enabled(ctx))

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        sites = [(n, n.meta[MERGE_SITE_KEY]) for n in graph.nodes if MERGE_SITE_KEY in n.meta]
        marked = [(n, s) for n, s in sites if s.project]
        self.decision = {"merges": len(sites), "projected": 0, "gathered_weight_bytes": 0}
        if not marked:
            self.decision["reason"] = ("no merge marked for projection (see the dcp_attention / sfa_dcp decision)"
                                       if sites else "no MLA / SFA merge left in the graph (GQA: nothing "
                                       "to project; a merge the allreduce_fold pass folded: projected there)")
            return 0
        group = self.ctx.cp_collectives
        if group is None:  # the DCP pass marks nothing without a group; a hand-built context could
            raise RuntimeError("project_before_merge: a merge is marked but the context has no cp_collectives")
        tracer = fx.proxy.GraphAppendingTracer(graph)
        for merged, site in marked:
            proj = find_projection(merged, site.heads)
            if isinstance(proj, str):  # the DCP pass proved it on the same readers; a later pass changed them
                raise RuntimeError(f"project_before_merge: {proj}")
            gathered = group.all_gather(parameter_value(proj.parameter))  # group rank order (collective)
            parts = [proj.weight_of(p).contiguous() for p in gathered]  # each rank's operand (its views re-run)
            weight = torch.cat(parts, dim=proj.head_axis)  # [N*H, L, Dv] (per the equation's order)
            self.decision["gathered_weight_bytes"] += sum(p.numel() * p.element_size() for p in parts[1:])
            # The head dim the merge moves: the partial's (MLA: the latent L) -> the projection's (Dv).
            self.decision["merged_head_dim"] = [int(fake_value(site.out).shape[-1]), proj.out_dim]
            with graph.inserting_before(proj.user):
                # Static sizes: a fresh symbol per dim would have no source in the frame, and a
                # guard the einsum puts on one (HF's "thl,hvl->thv") breaks Dynamo's guard building.
                w_node = constant_buffer(gm, f"_cp_project_w_{merged.name}", weight, static_shapes=True)
                out = ShapedProxy(site.out, tracer)
                projected = torch.einsum(proj.equation, out, ShapedProxy(w_node, tracer))  # [T, N*H, Dv]
                new = dcp_compose.merge_partial(
                    dcp_compose.Partial(projected, ShapedProxy(site.lse, tracer), site.heads, site.dtype), site.ctx)
            proj.user.replace_all_uses_with(new.node)
            graph.erase_node(proj.user)
            _erase_old_merge(graph, merged, site)
            self.decision["projected"] += 1
        graph.lint()
        gm.recompile()
        return len(marked)


__all__ = ["ProjectBeforeMergePass", "MergeSite"]
