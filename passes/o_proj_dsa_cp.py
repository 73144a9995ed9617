"""DSA-CP o_proj pass: the row-parallel o_proj -> full weight on this rank's tokens.

Runs in the prefill graph (prefill, chunked, mixed, speculative batches) of an
`enable_dsa_cp` compile at tp > 1, dcp = 1. Decode graphs keep the ordinary
row-parallel o_proj (partial matmul + TP all-reduce): nothing is rewritten there.

Pattern (one per layer): a linear whose weight is a parameter placeholder — plain
`F.linear(x, W)` (no bias) or `cp::w8a8_{dynamic,static}_linear` — whose only user
is a sum all-reduce over the TP group, followed by its `wait_tensor`. That is a
row-parallel linear (input dim sharded). Which of them is the o_proj:

- declared: `@cp_module(o_proj=...)` / `compile_model(o_proj=...)` names its
  parameters (`ctx.role_of_parameter`); a declared o_proj that is not such a
  row-parallel linear is refused with a `ConfigError` naming the parameter;
- inferred otherwise: the row-parallel linear whose input is computed from an
  attention result (a `cp::` op or a DSA-CP all-to-all) without crossing an earlier
  TP all-reduce. The MLP's down projection reads the residual stream, which is past
  the o_proj's all-reduce, so it never matches.

Each match becomes `cp_compile.ops.parallel.o_proj.o_proj_full_weight` (all-gather of
the input-sharded parameters, token all-to-all, full-weight linear on the rows,
all-gather of the output rows), traced on FX proxies. The gathered weight is a
graph intermediate: no parameter, buffer, constant or output of full-weight size
is created, and the module's parameters are not touched.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx

from cp_compile.base.config import ConfigError
from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel import o_proj as o_proj_compose
from cp_compile.passes.base import CPPass
from cp_compile.passes.fx_utils import FakeTracer, parameter_fqn

_c10d = torch.ops._c10d_functional
_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)
_QUANT = {op: kind for packet, kind in ((torch.ops.cp.w8a8_dynamic_linear, "w8a8_dynamic"),
                                        (torch.ops.cp.w8a8_static_linear, "w8a8_static"))
          for op in (packet, packet.default)}
_QUANT_ARGS = {"w8a8_dynamic": ("x", "weight", "weight_scale", "weight_offset", "groups"),
               "w8a8_static": ("x", "weight", "input_scale", "input_offset", "quant_bias", "deq_scale")}


def _is(node: Any, op: torch._ops.OpOverloadPacket) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in (op, op.default)


class RowParallelMatch:
    """A linear -> TP all-reduce -> wait chain, bound to its arguments."""

    def __init__(self, linear: fx.Node, all_reduce: fx.Node, wait: fx.Node, kind: str,
                 args: dict[str, Any]) -> None:
        self.linear, self.all_reduce, self.wait, self.kind, self.args = linear, all_reduce, wait, kind, args

    @property
    def weight(self) -> fx.Node:
        return self.args["weight"]


def _bind_linear(node: fx.Node) -> tuple[str, dict[str, Any]] | None:
    if node.op != "call_function":
        return None
    if node.target in _LINEARS:
        args = list(node.args) + [node.kwargs.get(k) for k in ("input", "weight", "bias")[len(node.args):]]
        x, w = args[0], args[1]
        bias = args[2] if len(args) > 2 else node.kwargs.get("bias")
        if bias is not None:
            return None  # a bias before the reduction is not a row-parallel linear (it would be summed tp times)
        return "linear", dict(x=x, weight=w)
    kind = _QUANT.get(node.target)
    if kind is None:
        return None
    bound = dict(zip(_QUANT_ARGS[kind], node.args))
    bound.update(node.kwargs)
    return kind, bound


def find_row_parallel(gm: fx.GraphModule, tp_group: str) -> list[RowParallelMatch]:
    """Every linear -> sum all-reduce over `tp_group` -> wait chain whose weight is a placeholder."""
    out = []
    for ar in gm.graph.nodes:
        if not _is(ar, _c10d.all_reduce):
            continue
        src, reduce_op, group = ar.args[:3]
        users = list(ar.users)
        if reduce_op != "sum" or group != tp_group or len(users) != 1 or not _is(users[0], _c10d.wait_tensor):
            continue
        if not isinstance(src, fx.Node) or len(src.users) != 1:
            continue
        bound = _bind_linear(src)
        if bound is None or not isinstance(bound[1].get("weight"), fx.Node) or bound[1]["weight"].op != "placeholder":
            continue
        out.append(RowParallelMatch(src, ar, users[0], bound[0], bound[1]))
    return out


def _namespace(target: Any) -> str:
    """The op namespace of an OpOverload or OpOverloadPacket ("" for Python callables);
    Dynamo's graphs name custom ops by their packet, which has no `.namespace`."""
    name = getattr(target, "_qualified_op_name", None) or getattr(
        getattr(target, "_overloadpacket", None), "_qualified_op_name", "")
    return name.split("::")[0] if "::" in name else ""


def _reads_attention(start: fx.Node, stop: set[fx.Node]) -> bool:
    """Whether `start` depends on an attention result (a cp:: op other than the quantised
    linears, or an all-to-all) without passing through a node of `stop` (TP all-reduce waits)."""
    seen: set[fx.Node] = set()
    todo = [start]
    while todo:
        n = todo.pop()
        if n in seen or n in stop or n.op in ("placeholder", "get_attr"):
            continue
        seen.add(n)
        if n.op == "call_function":
            if (_namespace(n.target) == "cp" and n.target not in _QUANT) or _is(n, _c10d.all_to_all_single):
                return True
        todo.extend(a for a in n.all_input_nodes)
    return False


class OProjDSACPPass(CPPass):
    """Row-parallel o_proj -> full-weight o_proj on this rank's token shard (prefill graphs)."""

    name = "o_proj_dsa_cp"
    enabled_when = "enable_dsa_cp, prefill graph, tensor_parallel_size > 1, decode_context_parallel_size == 1"

    def __init__(self, ctx: CompileContext) -> None:
        super().__init__(ctx)
        self.shards = ctx.tp_view()

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        cfg = ctx.config
        return cfg.enable_dsa_cp and ctx.prefill_only and ctx.tp.size > 1 and ctx.dcp.size == 1

    def select(self, gm: fx.GraphModule) -> list[RowParallelMatch]:
        """The o_proj matches: the declared role's, or the inferred ones (module docstring)."""
        matches = find_row_parallel(gm, self.shards.tp.name)
        role = self.ctx.role("o_proj")
        if role is not None:
            by_fqn = {parameter_fqn(m.weight): m for m in matches}
            declared = [n for n in gm.graph.nodes if n.op == "placeholder" and parameter_fqn(n) is not None
                        and self.ctx.role_of_parameter(parameter_fqn(n)) == "o_proj"]
            weights = [n for n in declared if parameter_fqn(n).rsplit(".", 1)[-1] == "weight"]
            bad = [parameter_fqn(n) for n in weights if parameter_fqn(n) not in by_fqn]
            if bad:
                raise ConfigError(
                    "a declared o_proj is a row-parallel linear (weight input-sharded, output all-reduced over TP)",
                    f"o_proj={role.path!r}: parameter {bad[0]} is not the weight of F.linear(x, W) or "
                    f"cp::w8a8_*_linear followed by a sum all-reduce over the TP group ({self.ctx.describe()})",
                    "declare the row-parallel output projection of attention as o_proj, or compile with "
                    "enable_dsa_cp=False")
            return [by_fqn[parameter_fqn(n)] for n in weights]
        stop = {m.wait for m in matches}
        return [m for m in matches if _reads_attention(m.linear, stop)]

    def _nothing_to_rewrite(self, gm: fx.GraphModule) -> None:
        """Enabled (enable_dsa_cp, prefill graph) and no o_proj found: never a silent
        no-op (issue 19). Row-parallel linears that are all judged not to be the o_proj
        mean inference failed on this model: a ConfigError asking for the role. A graph
        without any row-parallel linear has no TP o_proj to rewrite: a warning."""
        linears = find_row_parallel(gm, self.shards.tp.name)
        if linears:
            raise ConfigError(
                "the o_proj pass finds the attention's o_proj under enable_dsa_cp",
                f"{len(linears)} row-parallel linear(s) in this prefill graph, none reading an attention result, "
                f"and no o_proj role declared ({self.ctx.describe()})",
                "declare it: @cp_module(o_proj='self_attn.o_proj') or compile_model(..., o_proj='self_attn.o_proj') "
                "(the path of the attention's output projection), or compile with enable_dsa_cp=False")
        warnings.warn("o_proj_dsa_cp: enable_dsa_cp is on but this prefill graph has no row-parallel linear "
                      "(F.linear or cp::w8a8_*_linear followed by a TP all-reduce): nothing to rewrite; the "
                      "attention's o_proj, if any, stays TP-sharded", stacklevel=2)

    def __call__(self, gm: fx.GraphModule) -> int:
        graph = gm.graph
        tracer = FakeTracer.for_graph(gm, "the o_proj pass")
        wrap = tracer.wrap
        count = 0
        selected = self.select(gm)
        if not selected:
            self._nothing_to_rewrite(gm)
        for m in selected:
            params = {k: wrap(v) for k, v in m.args.items() if k not in ("x", "groups")}
            with graph.inserting_before(m.linear):
                out = o_proj_compose.o_proj_full_weight(m.kind, wrap(m.args["x"]), params, self.shards,
                                                        groups=int(m.args.get("groups", 1)))
            m.wait.replace_all_uses_with(out.node)
            for n in (m.wait, m.all_reduce, m.linear):
                graph.erase_node(n)
            count += 1
        tracer.drop_unused_sizes()
        if count:
            graph.lint()
            gm.recompile()
        return count
