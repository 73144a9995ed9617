"""Reading back what torchair handed GE: the GE graph's ops, key attributes, HCCL
groups and I/O, the FX graph it converted, and the value comparison (tools/ge_eval)
of each compiled call, into one `GraphResult` per graph."""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tools import torchair_standin as standin

# Key attributes read off each GE op type (what the table prints and the tests assert).
KEY_ATTRS = {
    "FusedInferAttentionScore": ("num_heads", "num_key_value_heads", "input_layout", "softmax_lse_flag",
                                 "block_size", "sparse_mode", "scale", "key_antiquant_mode", "value_antiquant_mode"),
    "ScatterPaKvCache": ("cache_mode",),
    "ScatterNdUpdate": ("use_locking",),
    "AttentionUpdate": ("update_type", "sp"),
    "LightningIndexer": ("layout_query", "layout_key", "sparse_count", "sparse_mode"),
    "SparseFlashAttention": ("layout_query", "layout_kv", "sparse_mode", "scale_value", "return_softmax_lse"),
    "Sort": ("axis", "descending", "stable"),
    "HcomAllGather": ("group", "rank_size"),
    "HcomReduceScatter": ("group", "rank_size", "reduction"),
    "HcomAllToAllV": ("group",),
    "HcomAllReduce": ("group", "reduction"),
}
HCOM = ("HcomAllGather", "HcomReduceScatter", "HcomAllToAllV", "HcomAllReduce")


@dataclass
class GraphResult:
    name: str  # "op:<op>" or "<model> dcp=<n> <merge>"
    status: str  # ok | failed
    message: str = ""
    fx_nodes: int = 0  # call_function nodes torchair converted
    fx_targets: dict[str, int] = field(default_factory=dict)
    ge_ops: dict[str, int] = field(default_factory=dict)
    attrs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # GE op type -> attrs of each instance
    io: dict[str, list[str]] = field(default_factory=dict)  # inputs / outputs -> "name: dtype[shape]"
    groups: list[dict[str, Any]] = field(default_factory=list)  # HCCL ops: type, group, rank_list, rank_size
    expected_ranks: list[int] = field(default_factory=list)  # the DCP group's ranks (dcp > 1)
    tp_ranks: list[int] = field(default_factory=list)  # the TP group's ranks
    seconds: float = 0.0
    rank: int = 0
    text: str = ""  # the GE graph rendered by `render` (written under --dump, not into --json)
    # GE graph (tools/ge_eval) vs FX graph on the same inputs: one row per output / mutated
    # input and reading of an undocumented behaviour (tools/ge_eval/probe.py).
    values: list[dict[str, Any]] = field(default_factory=list)
    uncertain: dict[str, int] = field(default_factory=dict)  # undocumented behaviours the values rely on
    constraints: dict[str, int] = field(default_factory=dict)  # documented NPU limits the CI shapes miss
    mutation: str = ""  # under --mutations: the converter copy this op graph ran with



def _attr_value(a: Any) -> Any:  # a GE AttrDef (protobuf)
    kind = a.WhichOneof("value")
    if kind == "s":
        return a.s.decode()
    if kind == "list":
        return list(a.list.i) or [s.decode() for s in a.list.s] or list(a.list.f)
    return getattr(a, kind) if kind else None


def _desc(d: Any) -> str:  # a GE TensorDescriptor (protobuf)
    from torchair._ge_concrete_graph.ge_ir_pb2 import DataType

    shape = list(d.shape.dim) if d.HasField("shape") else []
    return f"{d.name}: {DataType.Name(d.dtype)}{shape}"


def read_graph(graph: Any, result: GraphResult) -> None:
    result.ge_ops = dict(Counter(op.type for op in graph.op))
    # What GE is handed: the graph inputs (Data) and outputs (NetOutput) with dtype and
    # shape (-1 = dynamic). Shapes inside the graph are GE's InferShape (CANN), not here.
    result.io["inputs"] = [_desc(op.output_desc[0]) for op in graph.op if op.type == "Data"]
    result.io["outputs"] = [_desc(d) for op in graph.op if op.type == "NetOutput" for d in op.input_desc]
    result.text = render(graph)
    for op in graph.op:
        if op.type in KEY_ATTRS:
            result.attrs.setdefault(op.type, []).append(
                {k: _attr_value(op.attr[k]) for k in KEY_ATTRS[op.type] if k in op.attr})
        if op.type in HCOM:
            group = op.attr["group"].s.decode()
            m = re.search(r"rank_list=([\d,]+)", group)
            result.groups.append(dict(type=op.type, group=group,
                                      rank_list=[int(x) for x in m.group(1).split(",")] if m else None,
                                      rank_size=op.attr["rank_size"].i if "rank_size" in op.attr else None))


def render(graph: Any) -> str:
    """The GE graph as text, one op per line: `name = Type(inputs) {attrs}`, in graph order.
    Internal attrs (leading `_`) are left out; Data / NetOutput lines carry dtype and shape."""
    lines = [f"# GE graph {graph.name}: {len(graph.op)} ops (torchair FX -> GE, as handed to GE's load)"]
    for op in graph.op:
        attrs = {k: _attr_value(v) for k, v in sorted(op.attr.items()) if not k.startswith("_") and
                 not k.startswith("[")}
        for k, v in attrs.items():
            if isinstance(v, bytes) or (isinstance(v, str) and len(v) > 80):
                attrs[k] = "..."
        desc = ""
        if op.type == "Data":
            desc = " -> " + _desc(op.output_desc[0])
        elif op.type == "NetOutput":
            desc = " <- " + ", ".join(_desc(d) for d in op.input_desc)
        text = ", ".join(op.input)
        lines.append(f"{op.name} = {op.type}({text})" + (f" {attrs}" if attrs else "") + desc)
    return "\n".join(lines) + "\n"


class FxRecorder:
    """Records the FX graph torchair converts (GeConcreteGraph.save_fx_graph) to count its nodes."""

    def __init__(self) -> None:
        from torchair._ge_concrete_graph.fx2ge_converter import GeConcreteGraph

        self.graphs: list[Any] = []
        original = GeConcreteGraph.save_fx_graph
        recorder = self

        def save_fx_graph(graph_self: GeConcreteGraph, gm: torch.fx.GraphModule) -> Any:
            recorder.graphs.append(gm)
            return original(graph_self, gm)

        GeConcreteGraph.save_fx_graph = save_fx_graph


def fx_targets(gm: torch.fx.GraphModule) -> Counter:
    from torchair._ge_concrete_graph.fx2ge_converter import _get_converter

    targets: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        target = n.args[0] if str(n.target) == "auto_functionalized_v2" else n.target
        name = str(target)
        try:
            has = _get_converter(target) is not None
        except (KeyError, AttributeError):
            has = False
        targets[name if has or name.startswith("<") else f"{name} (NO CONVERTER)"] += 1
    return targets


def compile_and_load(fn: Callable[[], Any], name: str, recorder: FxRecorder, rank: int = 0) -> GraphResult:
    """Run `fn` (which calls a torch.compile'd function once) and read the GE graph it loaded."""
    from tools.ge_eval import probe

    result = GraphResult(name=name, status="failed", rank=rank)
    start = time.perf_counter()
    loaded = len(standin.STATE.graphs)
    fx_seen = len(recorder.graphs)
    compared = len(probe.RESULTS)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the conversion error is the result
        result.message = f"{type(e).__name__}: {e}"[:3000]
    comparisons = probe.RESULTS[compared:]
    for c in comparisons:
        result.values += [dict(r, graph=c.graph) for r in c.rows]
        for k, v in c.uncertain.items():
            result.uncertain[k] = result.uncertain.get(k, 0) + v
        for k, v in c.constraints.items():
            result.constraints[k] = result.constraints.get(k, 0) + v
    value_failures = [f"{c.graph}: {f}" for c in comparisons for f in c.failures()]
    if value_failures and not result.message:
        result.message = f"{name}: GE graph differs from the FX graph by value: " + "; ".join(value_failures)[:3000]
    elif not comparisons and not result.message:
        result.message = "no GE graph was run (the value check compared nothing)"
    result.seconds = time.perf_counter() - start
    new = standin.STATE.graphs[loaded:]
    for gm in recorder.graphs[fx_seen:]:
        t = fx_targets(gm)
        result.fx_targets.update({k: result.fx_targets.get(k, 0) + v for k, v in t.items()})
        result.fx_nodes += sum(t.values())
    if new and not result.message:
        if len(new) != 1:
            result.message = f"expected one GE graph, got {len(new)}"
        else:
            read_graph(new[0].graph, result)
            result.status = "ok"
    elif not new and not result.message:
        result.message = "no GE graph was loaded"
    return result

