"""DCP attention pass: single-device attention nodes -> DCP building blocks.

Every `cp::gqa_paged_attention` / `cp::mla_attention` node becomes: local cache
write, Q all-gather over the DCP group, partial attention over the local shard
returning (out, lse), and the LSE merge (all-gather + reduce-scatter, or one
all-to-all). Metadata localisation is inserted once per graph, before the first
attention node, and shared by every layer. The collectives are `_c10d_functional`
nodes, so later lowerings (Inductor, torchair) see and schedule them.

The replacement is produced by calling the compositions of
`cp_compile.ops.parallel.dcp` on FX proxies: one implementation serves eager mode and
graph mode (docs/architecture.md, "Adding a pass").
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel import dcp as dcp_compose
from cp_compile.passes.base import CPPass
from cp_compile.passes.fx_utils import ShapedProxy, bind_op_args, fake_value
from cp_compile.base.merge_cost import FoldWeights, ProjectionWeights
from cp_compile.passes.fold_match import find_fold
from cp_compile.passes.projection_match import MERGE_SITE_KEY, MergeSite, find_projection
from cp_compile.base.config import ConfigError
from cp_compile.passes.merge_choice import resolve_merge
from cp_compile.passes.query_replication import (NotReplicable, QueryChain, check_replicated_inputs, query_chain,
                                                 replicate_queries)


NOTHING_TO_PROJECT = "GQA: the attention output is already in the V head dim (nothing to project)"


class AttentionPattern:
    """One single-device attention op and the composition that replaces it."""

    op: torch._ops.OpOverloadPacket
    composition: Callable[..., Any]
    queries: tuple[str, ...] = ("q",)  # the query arguments (replicated under dcp_merge="replicate")
    # The composition up to the merge (returns `dcp.Partial`), for outputs a per-head projection
    # may follow (MLA's latent: project before the merge, issue 37); None: already in the V head dim.
    partial: Callable[..., Any] | None = None
    # The composition up to the merge for the all-reduce fold (decision 62): GQA's too; None: not built.
    fold_partial: Callable[..., Any] | None = None

    def matches(self, node: fx.Node) -> bool:
        return node.op == "call_function" and node.target in (self.op, self.op.default)

    def bind(self, node: fx.Node) -> dict[str, Any]:
        return bind_op_args(self.op, node)


def rewrite_attention_nodes(graph: fx.Graph, patterns: tuple[AttentionPattern, ...], wrap: Callable[[Any], Any],
                            shared: Callable[..., Any], rewrite: Callable[..., Any]
                            ) -> tuple[int, dict[tuple[fx.Node, ...], Any]]:
    """Replace every node of `patterns` by `rewrite(pattern, wrapped_args, shared_value)`.

    `shared(slot_mapping, query_start_loc, seq_lens)` (wrapped) is built once per graph
    per distinct metadata, before the first attention node that reads it, and every
    layer reuses it (DCP's localised metadata, PCP's step). Returns the number of nodes
    replaced and the shared values by metadata key.
    """
    shared_by_meta: dict[tuple[fx.Node, ...], Any] = {}
    count = 0
    for node in list(graph.nodes):
        pattern = next((p for p in patterns if p.matches(node)), None)
        if pattern is None:
            continue
        args = pattern.bind(node)
        key = (args["slot_mapping"], args["query_start_loc"], args["seq_lens"])
        with graph.inserting_before(node):
            if key not in shared_by_meta:
                shared_by_meta[key] = shared(*(wrap(k) for k in key))
            out = rewrite(pattern, {k: wrap(v) for k, v in args.items()}, shared_by_meta[key])
        node.replace_all_uses_with(out.node)
        graph.erase_node(node)
        count += 1
    return count, shared_by_meta


class GQAPattern(AttentionPattern):
    op = torch.ops.cp.gqa_paged_attention
    composition = staticmethod(dcp_compose.dcp_gqa_attention)
    fold_partial = staticmethod(dcp_compose.dcp_gqa_partial)


class MLAPattern(AttentionPattern):
    op = torch.ops.cp.mla_attention
    composition = staticmethod(dcp_compose.dcp_mla_attention)
    partial = staticmethod(dcp_compose.dcp_mla_partial)
    fold_partial = staticmethod(dcp_compose.dcp_mla_partial)
    queries = ("q_nope", "q_pe")


class GQAQuantPattern(GQAPattern):
    """GQA over a quantised cache (issue 39): the same composition, with the scale caches."""

    op = torch.ops.cp.gqa_paged_attention_quant


class MLAQuantPattern(MLAPattern):
    op = torch.ops.cp.mla_attention_quant


class DCPAttentionPass(CPPass):
    """Rewrite single-device paged attention into DCP-sharded attention."""

    name = "dcp_attention"
    patterns: tuple[AttentionPattern, ...] = (GQAPattern(), MLAPattern(), GQAQuantPattern(), MLAQuantPattern())
    handles = tuple(p.op for p in patterns)
    enabled_when = ("decode_context_parallel_size > 1 (pcp = 1), or decode graphs at "
                    "prefill_context_parallel_size > 1 (over the pcp * dcp ranks of the cache)")

    def __init__(self, ctx: CompileContext) -> None:
        super().__init__(ctx)
        # The cache's context-parallel group: the DCP group at pcp = 1, the pcp * dcp
        # ranks the PCP prefill sharded the cache over at pcp > 1 (docs/pcp.md §5).
        self.cp = ctx.cp_view()

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        if ctx.pcp.size > 1:
            # Prefill graphs are token-sharded by the pcp_attention pass instead.
            return ctx.decode_like
        return ctx.dcp.size > 1

    def prepare(self, gm: fx.GraphModule) -> None:
        """Hook before the rewrite (subclasses check or claim other nodes here)."""

    # Query replication (dcp_merge="replicate") is built for these patterns (GQA, MLA).
    replicates_queries = True

    def query_chains(self, gm: fx.GraphModule) -> tuple[dict[fx.Node, QueryChain], str | None]:
        """Each attention node's replicable query chain, or ({}, why not). Collective over
        the group (every rank compiles the same graph)."""
        if not self.replicates_queries:
            return {}, f"query replication is not built for the {self.name} pass"
        nodes = [(n, p) for n in gm.graph.nodes for p in self.patterns if p.matches(n)]
        caches = {v for n, p in nodes for k, v in p.bind(n).items() if "cache" in k and isinstance(v, fx.Node)}
        chains = {}
        try:
            for node, pattern in nodes:
                args = pattern.bind(node)
                queries = tuple(args[q] for q in pattern.queries)
                others = [v for k, v in args.items() if k not in pattern.queries and isinstance(v, fx.Node)]
                chains[node] = query_chain(gm.graph, queries, others)
            group = self.ctx.cp_collectives
            if group is None:
                return {}, "no process group to gather the query parameters over (a context without init_parallel)"
            for node, chain in chains.items():
                check_replicated_inputs(chain, caches, group)
        except NotReplicable as why:
            return {}, str(why)
        return chains, None

    def projections(self, gm: fx.GraphModule) -> tuple[ProjectionWeights | None, str | None]:
        """The per-layer projection weights project-before-merge would apply (every attention
        node's output provably followed by one, passes/projection_match.py), or (None, why not)."""
        nodes = [(n, p) for n in gm.graph.nodes for p in self.patterns if p.matches(n)]
        if not nodes:
            return None, None
        if any(p.partial is None for _, p in nodes):
            return None, NOTHING_TO_PROJECT
        # At pcp > 1 a decode graph is the DCP decode at N = pcp * dcp over the cp group (docs/pcp.md
        # §5): the partial holds the cp group's heads in cp rank order, and W_UV is gathered over the
        # same group in the same order (duplicates from PCP peers included), so the proof is the same.
        found = []
        for node, pattern in nodes:
            heads = int(fake_value(pattern.bind(node)["q_nope"]).shape[1])
            proj = find_projection(node, heads)
            if isinstance(proj, str):
                return None, proj
            found.append(proj)
        if self.ctx.cp_collectives is None:
            return None, "no process group to gather the projection weights over (a context without init_parallel)"
        w = fake_value(found[0].weight)
        return ProjectionWeights(bytes=w.numel() * w.element_size(), matrix_elements=w.numel(),
                                 out_dim=found[0].out_dim), None

    def folds(self, gm: fx.GraphModule) -> tuple[FoldWeights | None, str | None]:
        """The per-layer o_proj weights the all-reduce fold would gather (every attention node's
        output provably read by a row-parallel o_proj and its TP all-reduce alone,
        passes/fold_match.py), or (None, why not)."""
        nodes = [(n, p) for n in gm.graph.nodes for p in self.patterns if p.matches(n)]
        if not nodes:
            return None, None
        missing = [type(p).__name__ for _, p in nodes if p.fold_partial is None]
        if missing:
            return None, f"the all-reduce fold is not built for {missing[0]} ({self.name} pass)"
        layout = self.ctx.layout
        if layout.cp.size != layout.dcp.size:
            # The fold leaves the sum over the merge's group to the TP all-reduce, so that group must
            # lie inside the TP group. The DCP ranks do (consecutive inside a TP group); the cp group
            # at pcp > 1 does not: its PCP peers hold the same TP rank in the other TP groups.
            return None, (f"the merge runs over the cp group ({layout.cp.size} = pcp {layout.pcp.size} x dcp "
                          f"{layout.dcp.size} ranks), which reaches beyond this rank's TP group: its PCP peers sit "
                          "in the other TP groups, so the TP all-reduce after o_proj never adds their weighted "
                          "partials (the fold needs the merge's ranks inside the all-reduce's group: pcp = 1)")
        if self.ctx.tp.size == 1:
            return None, "no TP all-reduce after o_proj to fold the merge into (tensor_parallel_size = 1)"
        found, kv = [], {}
        for node, pattern in nodes:
            args = pattern.bind(node)
            q = fake_value(args["q"] if "q" in args else args["q_nope"])
            fold = find_fold(node, int(q.shape[1]), self.ctx.tp.name, pattern.partial is not None)
            if isinstance(fold, str):
                return None, fold
            found.append(fold)
            kv.update({v: fake_value(v) for k, v in args.items() if "cache" in k and isinstance(v, fx.Node)})
        if self.ctx.cp_collectives is None:
            return None, "no process group to gather the o_proj columns over (a context without init_parallel)"
        w = fake_value(found[0].weight)
        n = self.cp.group.size
        proj = found[0].projection
        projection = None
        extra = (n - 1) * sum(fake_value(f.weight).numel() * fake_value(f.weight).element_size() for f in found)
        if proj is not None:
            pw = fake_value(proj.weight)
            projection = ProjectionWeights(bytes=pw.numel() * pw.element_size(), matrix_elements=pw.numel(),
                                           out_dim=proj.out_dim)
            extra += (n - 1) * len(found) * projection.bytes
        kv_bytes = sum(t.numel() * t.element_size() for t in kv.values() if t is not None)
        return FoldWeights(bytes=w.numel() * w.element_size(), matrix_elements=w.numel(), extra_bytes=int(extra),
                           kv_bytes=int(kv_bytes), projection=projection), None

    def __call__(self, gm: fx.GraphModule) -> int:
        self.prepare(gm)
        fold = self.ctx.config.dcp_merge_fold
        fold_weights, not_foldable = self.folds(gm) if fold != "off" else (None, None)
        if fold == "on" and not_foldable is not None:
            raise ConfigError("dcp_merge_fold='on' needs each attention output provably read by a row-parallel o_proj "
                              "(no bias before its TP all-reduce) and that all-reduce alone",
                              f"{not_foldable} ({self.ctx.describe()})",
                              "use dcp_merge_fold='auto' (folds where provable and cheaper) or 'off'")
        project = self.ctx.config.dcp_project_before_merge
        projection, not_projectable = self.projections(gm) if project != "off" else (None, None)
        if project == "on" and not_projectable not in (None, NOTHING_TO_PROJECT):
            raise ConfigError("dcp_project_before_merge='on' needs each attention output provably followed by a "
                              "per-head linear projection with parameter weights",
                              f"{not_projectable} ({self.ctx.describe()})",
                              "use dcp_project_before_merge='auto' (projects where provable) or 'off'")
        chains, why = {}, None
        # "auto" without measured costs keeps AG+RS (merge_cost.choose): no chain analysis then.
        if self.cp.merge == "replicate" or (self.cp.merge == "auto" and self.ctx.collective_costs is not None):
            chains, why = self.query_chains(gm)
        if self.cp.merge == "replicate" and why is not None:
            raise ConfigError("dcp_merge='replicate' needs a replicable query projection",
                              f"{why} ({self.ctx.describe()})",
                              "use dcp_merge='a2a' (the same merge with the query all-gather) or 'auto'")
        first = next(iter(chains.values()), None)
        self.cp, self.decision = resolve_merge(self.ctx, self.cp, gm, self.patterns,
                                               first.weights if first else None, why, project=project,
                                               projection=projection,
                                               # GQA: nothing to record (the project pass says it)
                                               not_projectable=None if not_projectable == NOTHING_TO_PROJECT
                                               else not_projectable, fold=fold, fold_weights=fold_weights,
                                               not_foldable=not_foldable)
        project_here = bool(self.decision and self.decision.get("project"))
        fold_here = bool(self.decision and self.decision.get("fold"))
        if self.cp.replicated:
            for node, chain in chains.items():
                for old, new in zip(chain.outputs, replicate_queries(gm, node, chain, self.cp.group.rank,
                                                                     self.ctx.cp_collectives)):
                    node.replace_input_with(old, new)
        graph = gm.graph
        tracer = fx.proxy.GraphAppendingTracer(graph)
        wrap = lambda a: fx.map_arg(a, lambda n: ShapedProxy(n, tracer))  # noqa: E731
        # Metadata localisation once per graph (per distinct metadata): every layer reuses it.
        count, _ = rewrite_attention_nodes(
            graph, self.patterns, wrap, lambda *meta: dcp_compose.localize(self.cp, *meta),
            lambda pattern, args, local: self._rewrite(pattern, args, local, project_here, fold_here))
        if count:
            # No dead-code elimination: the cache writes have no users by design.
            graph.lint()
            gm.recompile()
        return count

    def _rewrite(self, pattern: AttentionPattern, args: dict[str, Any], local: Any, project: bool,
                 fold: bool = False) -> Any:
        """One attention node's composition; where a partial exists, the merge is built here
        and marked (`MergeSite`) for the project-before-merge pass, or, where the decision
        says fold, for the all-reduce fold pass (GQA's partial too)."""
        partial = pattern.fold_partial if fold else pattern.partial
        if partial is None:
            return pattern.composition(**args, ctx=self.cp, local=local)
        part = partial(**args, ctx=self.cp, local=local)
        merged = dcp_compose.merge_partial(part, self.cp)
        merged.node.meta[MERGE_SITE_KEY] = MergeSite(part.out.node, part.lse.node, part.heads, part.dtype,
                                                     self.cp, project, fold, pattern.partial is not None)
        return merged
