"""PCP attention pass: token-shard a prefill graph over the PCP group (docs/pcp.md §4).

Runs on prefill graphs at prefill_context_parallel_size > 1 (`ctx.prefill_only`:
"prefill", or "fresh_prefill" for steps without cached context, whose compositions
skip the context part, `PCPContext.fresh`; decode graphs keep every token on every
rank and run `dcp_attention` over the pcp * dcp ranks of the cache instead).

What the graph looks like when it gets here. At pcp > 1 the compiled entry
(`decorator.CompiledForward`) compiles prefill steps through a wrapper that takes this
rank's token indices as an extra argument ([T_loc] int64, ascending, -1 padded: row
`pcp_rank` of `ops.pcp_layout.pcp_token_table`, computed on the host once per step),
marks them with `cp::pcp_token_index` (ops/pcp/ops.py) and slices the model's token-dim
arguments (input_ids, positions) to those rows *inside the graph*, before calling the
model. So the model is traced on T_loc tokens while its metadata stays global (T
tokens). The pass finds the token indices as the argument of the marker's one call
(the parameter's name plays no part) and removes the call.

What the pass does:
1. every `cp::gqa_paged_attention` / `cp::mla_attention` becomes `pcp_gqa_attention` /
   `pcp_mla_attention` (ops/parallel/pcp.py), with one `pcp_step` per graph
   (per distinct metadata) shared by the layers, like `localize` in dcp_attention;
2. every graph output whose dim 0 is the local token count (T_loc) is put back in
   global order on every rank: one all-gather over PCP and a row permutation with the
   token indices `pcp_step` gathered (`pcp_restore_tokens`), zeros on batch padding.
   The caller gets [T, ...] exactly as from one device (logits of every token); a
   sampler that reads only the last token of each request could gather less (not
   built: the graph cannot know which outputs the caller reads).

Symbolic sizes: the compositions use the global token count T (e.g. `arange(T)`).
Under a graph pass T is a traced size, so the proxies this pass hands them answer
`.shape` with `aten.sym_size` nodes for symbolic dims (`fx_utils.SizedProxy`): the rewritten
graph computes its sizes at run time instead of baking in the traced ones.
"""

from __future__ import annotations

import dataclasses

from typing import Any

import torch
import torch.fx as fx

from cp_compile.base.config import ConfigError
from cp_compile.passes.context import CompileContext
from cp_compile.ops.pcp import ops as pcp_ops
from cp_compile.ops.parallel import pcp as pcp_compose
from cp_compile.passes.base import CPPass
from cp_compile.passes.dcp_attention import AttentionPattern, rewrite_attention_nodes
from cp_compile.passes.fx_utils import FakeTracer, fake_value
from cp_compile.passes.merge_choice import resolve_merge

# The marker the compiled entry calls on this rank's token indices (decorator.py).
TOKEN_INDEX_MARKER = pcp_ops.pcp_token_index._opoverload


class PCPGQAPattern(AttentionPattern):
    op = torch.ops.cp.gqa_paged_attention
    composition = staticmethod(pcp_compose.pcp_gqa_attention)


class PCPMLAPattern(AttentionPattern):
    op = torch.ops.cp.mla_attention
    composition = staticmethod(pcp_compose.pcp_mla_attention)


class PCPGQAQuantPattern(PCPGQAPattern):
    """GQA over a quantised cache (issue 39): the same composition, the scale caches passed by name."""

    op = torch.ops.cp.gqa_paged_attention_quant


class PCPMLAQuantPattern(PCPMLAPattern):
    op = torch.ops.cp.mla_attention_quant


def _same_size(a: Any, b: Any) -> bool:
    """Whether two sizes are the same size *structurally* (the same symbol, or equal
    ints); comparing SymInts with == would add a guard to the shape environment."""
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return False
    return int(a) == int(b)


def token_index_markers(gm: fx.GraphModule) -> list[fx.Node]:
    """The calls of `cp::pcp_token_index` in the graph (the compiled entry makes one)."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target == TOKEN_INDEX_MARKER]


class PCPAttentionPass(CPPass):
    """Token-shard a prefill graph over PCP (see module docstring)."""

    name = "pcp_attention"
    patterns: tuple[AttentionPattern, ...] = (PCPGQAPattern(), PCPMLAPattern(), PCPGQAQuantPattern(),
                                              PCPMLAQuantPattern())
    handles = tuple(p.op for p in patterns)
    enabled_when = "prefill_context_parallel_size > 1 (prefill graphs)"

    def __init__(self, ctx: CompileContext) -> None:
        super().__init__(ctx)
        self.pcp = ctx.pcp_view()

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        # Decode and verify graphs run the whole batch on every rank (dcp_attention).
        return ctx.pcp.size > 1 and not ctx.decode_like

    def _refuse(self, problem: str) -> ConfigError:
        return ConfigError("PCP prefill graphs come from the compiled entry (one graph per batch kind)",
                           f"{problem} with {self.ctx.describe()}",
                           "compile the model with cp_compile.compile_model or @cp_compile.cp_module (they shard "
                           "the prefill tokens per step and pick the decode or prefill graph); a plain "
                           "torch.compile(backend='cp_ascend') serves only prefill_context_parallel_size=1")

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        if self.ctx.batch_kind is None:
            raise self._refuse("a graph serving every batch kind")
        if self.pcp.merge == "replicate":
            # PCP prefill attention gathers its queries over DCP and tokens (ops/parallel/pcp.py);
            # replication is built for the DCP pass (decode graphs at pcp > 1). Same merge: A2A.
            self.pcp = dataclasses.replace(self.pcp, merge="a2a")
            self.decision = {"merge": "a2a", "reason": "dcp_merge='replicate': PCP prefill graphs gather their "
                             "queries; the merge is the all-to-all"}
        else:
            self.pcp, self.decision = resolve_merge(self.ctx, self.pcp, gm, self.patterns)
        markers = token_index_markers(gm)
        if len(markers) != 1:
            raise self._refuse(f"a prefill graph with {len(markers)} calls of cp::pcp_token_index (the marker of "
                               f"this rank's token indices; the compiled entry makes exactly one)")
        # The marked tensor is the token index; the marker itself goes (it is an identity).
        (marker,) = markers
        ti = marker.args[0]
        assert isinstance(ti, fx.Node)
        marker.replace_all_uses_with(ti)
        graph.erase_node(marker)
        tracer = FakeTracer.for_graph(gm, "the PCP attention pass")
        wrap = tracer.wrap
        # One pcp_step per graph (per distinct metadata): the token-index gather and the
        # cache localisation every layer shares.
        count, steps = rewrite_attention_nodes(
            graph, self.patterns, wrap, lambda *meta: pcp_compose.pcp_step(self.pcp, wrap(ti), *meta),
            lambda pattern, args, step: pattern.composition(**args, token_index=wrap(ti), ctx=self.pcp, step=step))
        count += self._restore_outputs(gm, ti, next(iter(steps.values()), None), wrap)
        tracer.drop_unused_sizes()
        if count:
            # No dead-code elimination: the cache writes have no users by design.
            graph.lint()
            gm.recompile()
        return count

    def _restore_outputs(self, gm: fx.GraphModule, ti: fx.Node, step: Any, wrap: Any) -> int:
        """Outputs with T_loc rows -> T rows in global order (module docstring, 2.)."""
        graph = gm.graph
        out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
        t_loc = fake_value(ti).shape[0]
        restored: dict[fx.Node, fx.Node] = {}

        def per_token(n: fx.Node) -> bool:
            val = fake_value(n)
            return isinstance(val, torch.Tensor) and val.dim() >= 1 and _same_size(val.shape[0], t_loc)

        def restore(n: fx.Node) -> fx.Node:
            if n is ti or not per_token(n):
                return n
            if n not in restored:
                if step is None:
                    raise ConfigError("a PCP prefill graph has attention (its token order comes from it)",
                                      f"output {n.name} has a row per local token but the graph has no "
                                      f"cp.gqa_paged_attention / cp.mla_attention node",
                                      "run models without attention at prefill_context_parallel_size=1")
                with graph.inserting_before(out_node):
                    restored[n] = pcp_compose.pcp_restore_tokens(wrap(n), step, self.pcp).node
            return restored[n]

        out_node.args = fx.map_arg(out_node.args, restore)
        return len(restored)
