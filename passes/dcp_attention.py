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
from cp_compile.passes.fx_utils import ShapedProxy, bind_op_args
from cp_compile.passes.merge_choice import resolve_merge


class AttentionPattern:
    """One single-device attention op and the composition that replaces it."""

    op: torch._ops.OpOverloadPacket
    composition: Callable[..., Any]

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


class MLAPattern(AttentionPattern):
    op = torch.ops.cp.mla_attention
    composition = staticmethod(dcp_compose.dcp_mla_attention)


class DCPAttentionPass(CPPass):
    """Rewrite single-device paged attention into DCP-sharded attention."""

    name = "dcp_attention"
    patterns: tuple[AttentionPattern, ...] = (GQAPattern(), MLAPattern())
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

    def __call__(self, gm: fx.GraphModule) -> int:
        self.prepare(gm)
        self.cp, self.decision = resolve_merge(self.ctx, self.cp, gm, self.patterns)
        graph = gm.graph
        tracer = fx.proxy.GraphAppendingTracer(graph)
        wrap = lambda a: fx.map_arg(a, lambda n: ShapedProxy(n, tracer))  # noqa: E731
        # Metadata localisation once per graph (per distinct metadata): every layer reuses it.
        count, _ = rewrite_attention_nodes(
            graph, self.patterns, wrap, lambda *meta: dcp_compose.localize(self.cp, *meta),
            lambda pattern, args, local: pattern.composition(**args, ctx=self.cp, local=local))
        if count:
            # No dead-code elimination: the cache writes have no users by design.
            graph.lint()
            gm.recompile()
        return count
