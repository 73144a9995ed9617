"""DCP attention pass: single-device attention nodes -> DCP building blocks.

Every `cp::gqa_paged_attention` / `cp::mla_attention` node becomes: local cache
write, Q all-gather over the DCP group, partial attention over the local shard
returning (out, lse), and the LSE merge (all-gather + reduce-scatter, or one
all-to-all). Metadata localisation is inserted once per graph, before the first
attention node, and shared by every layer. The collectives are `_c10d_functional`
nodes, so later lowerings (Inductor, torchair) see and schedule them.

The replacement is produced by calling the eager compositions of
`cp_compile.ops.dcp_attention` on FX proxies: one implementation serves eager
mode and graph mode.
"""

from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx

from cp_compile.ops import dcp_attention as compose
from cp_compile.passes.base import CPPass


class _ShapedProxy(fx.Proxy):
    """A proxy for an existing node that answers `.shape` / `.dtype` from its fake value.

    The compositions read head counts and dtypes off their *inputs* only; nodes
    the pass creates carry no fake value, and asking them raises.
    """

    def _fake(self) -> torch.Tensor:
        val = self.node.meta.get("example_value", self.node.meta.get("val"))
        if not isinstance(val, torch.Tensor):
            raise RuntimeError(f"node {self.node.name} has no fake tensor value; the DCP pass reads shapes only "
                               f"from the attention op's inputs")
        return val

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self._fake().shape

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._fake().dtype


class AttentionPattern:
    """One single-device attention op and the composition that replaces it."""

    op: torch._ops.OpOverloadPacket
    composition: Callable[..., Any]

    def matches(self, node: fx.Node) -> bool:
        return node.op == "call_function" and node.target in (self.op, self.op.default)

    def bind(self, node: fx.Node) -> dict[str, Any]:
        names = [a.name for a in self.op.default._schema.arguments]
        bound = dict(zip(names, node.args))
        bound.update(node.kwargs)
        missing = [n for n in names if n not in bound]
        if missing:
            raise RuntimeError(f"{node.format_node()}: arguments {missing} not found; cannot rewrite for DCP")
        return bound


class GQAPattern(AttentionPattern):
    op = torch.ops.cp.gqa_paged_attention
    composition = staticmethod(compose.dcp_gqa_attention)


class MLAPattern(AttentionPattern):
    op = torch.ops.cp.mla_attention
    composition = staticmethod(compose.dcp_mla_attention)


class DCPAttentionPass(CPPass):
    """Rewrite single-device paged attention into DCP-sharded attention."""

    name = "dcp_attention"
    config_fields = ("dcp", "rank", "interleave", "block_size", "group_name", "merge")
    patterns: tuple[AttentionPattern, ...] = (GQAPattern(), MLAPattern())

    def __init__(self, ctx: compose.DCPContext) -> None:
        self.ctx = ctx
        for f in self.config_fields:
            setattr(self, f, getattr(ctx, f))

    def __call__(self, gm: fx.GraphModule) -> int:
        if self.ctx.dcp == 1:
            return 0
        graph = gm.graph
        tracer = fx.proxy.GraphAppendingTracer(graph)
        wrap = lambda a: fx.map_arg(a, lambda n: _ShapedProxy(n, tracer))  # noqa: E731
        local_by_meta: dict[tuple[fx.Node, ...], compose.LocalMetadata] = {}
        count = 0
        for node in list(graph.nodes):
            pattern = next((p for p in self.patterns if p.matches(node)), None)
            if pattern is None:
                continue
            args = pattern.bind(node)
            key = (args["slot_mapping"], args["query_start_loc"], args["seq_lens"])
            with graph.inserting_before(node):
                if key not in local_by_meta:
                    # Once per graph (per distinct metadata): every layer reuses it.
                    local_by_meta[key] = compose.localize(self.ctx, *(wrap(k) for k in key))
                out = pattern.composition(**{k: wrap(v) for k, v in args.items()}, ctx=self.ctx,
                                          local=local_by_meta[key])
            node.replace_all_uses_with(out.node)
            graph.erase_node(node)
            count += 1
        if count:
            # No dead-code elimination: the cache writes have no users by design.
            graph.lint()
            gm.recompile()
        return count


def count_ops(gm: fx.GraphModule) -> dict[str, int]:
    """Histogram of call_function targets (for snapshots and tests)."""
    hist: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            name = str(n.target)
            hist[name] = hist.get(name, 0) + 1
    return hist
