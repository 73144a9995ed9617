"""FX helpers shared by the passes: op histograms, shaped proxies, fake values.

Two proxies let the parallel compositions (written for tensors) be traced into a
graph: `ShapedProxy` for compositions that read only static dims (head counts,
head sizes: DCP, SFA DCP), and `SizedProxy` with `FakeTracer` for those that compute
with the token count (DSA-CP's token shard, PCP's global T, the o_proj rows): it
records that arithmetic as `sym_size` nodes.

Passes work on Dynamo's FX graph, whose nodes carry their fake tensor in
`node.meta["example_value"]`. Nodes a pass creates carry none until
`propagate_fake_values` runs them on fake inputs; the pass manager does that after
every pass, so a later pass can read the shape of anything an earlier one built.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Iterable

import torch
import torch.fx as fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

VALUE_KEY = "example_value"  # Dynamo's key for a node's fake value
# A pass that keeps a single-device op as it is, because it is exact under the
# context's layout (e.g. the indexer over its replicated cache under SFA DCP), marks
# the node with its name here; the unsharded-attention check accepts marked nodes.
CLAIMED_KEY = "cp_claimed_by"


def fake_value(node: fx.Node) -> Any:
    return node.meta.get(VALUE_KEY, node.meta.get("val"))


def bind_op_args(op: torch._ops.OpOverloadPacket, node: fx.Node) -> dict[str, Any]:
    """A node of `op`'s arguments by schema name (Dynamo passes some as kwargs).
    A missing one is a RuntimeError: a pass cannot rewrite a call it cannot read."""
    schema = op.default._schema.arguments
    names = [a.name for a in schema]
    bound = dict(zip(names, node.args), **node.kwargs)
    # An argument the call left out takes its schema default (the optional scale caches of a
    # quantised KV cache, issue 39: None for a cache in the model's dtype).
    for a in schema:
        if a.name not in bound and a.has_default_value():
            bound[a.name] = a.default_value
    missing = [n for n in names if n not in bound]
    if missing:
        raise RuntimeError(f"{node.format_node()}: arguments {missing} of {op} not found; cannot rewrite it")
    return bound


def count_ops(gm: fx.GraphModule) -> dict[str, int]:
    """Histogram of call_function targets (for snapshots and tests)."""
    hist: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            name = str(n.target)
            hist[name] = hist.get(name, 0) + 1
    return hist


def op_nodes(gm: fx.GraphModule, ops: Iterable[torch._ops.OpOverloadPacket]) -> list[fx.Node]:
    """call_function nodes whose target is one of `ops` (packet or any overload)."""
    targets: set[Any] = set()
    for op in ops:
        targets.add(op)
        targets.update(getattr(op, o) for o in op.overloads())
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target in targets]


class ShapedProxy(fx.Proxy):
    """A proxy for an existing node that answers `.shape` / `.dtype` from its fake value,
    so code written for tensors (the parallel compositions) can read them while tracing."""

    def _fake(self) -> torch.Tensor:
        val = fake_value(self.node)
        if not isinstance(val, torch.Tensor):
            raise RuntimeError(f"node {self.node.name} has no fake tensor value; run "
                               f"propagate_fake_values on the nodes a pass creates before reading their shapes")
        return val

    @property
    def shape(self) -> torch.Size:  # type: ignore[override]
        return self._fake().shape

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._fake().dtype


def graph_fake_mode(graph: fx.Graph) -> FakeTensorMode | None:
    """The fake mode of the graph's own values (None for a graph Dynamo did not trace).

    Not `detect_fake_mode`: inside a backend call the tracing context holds a fresh
    fake mode that the graph's values do not belong to, and fake tensors of two modes
    cannot meet in one op.
    """
    return next((v.fake_mode for v in map(fake_value, graph.nodes) if isinstance(v, FakeTensor)), None)


def _run_fake(node: fx.Node) -> Any:
    args, kwargs = fx.map_arg((node.args, node.kwargs), fake_value)
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    return getattr(args[0], node.target)(*args[1:], **kwargs)


def propagate_fake_values(gm: fx.GraphModule) -> int:
    """Give every call node without a fake value one, by running it on fake inputs.

    Runs in graph order under the graph's fake mode (so symbolic sizes stay symbolic)
    and the Python dispatcher, as Dynamo runs ops: composite ops (`F.pad` of a token
    shard) take symbolic sizes only through their Python decompositions. Returns the
    number of nodes filled in; a graph with no fake values at all is left alone.
    """
    mode = graph_fake_mode(gm.graph)
    if mode is None:
        return 0
    filled = 0
    with mode, enable_python_dispatcher():
        for n in gm.graph.nodes:
            # Presence, not truth: ops that return None (cache writes) have a value of None.
            if n.op not in ("call_function", "call_method") or VALUE_KEY in n.meta or "val" in n.meta:
                continue
            n.meta[VALUE_KEY] = _run_fake(n)
            filled += 1
    return filled


class FakeTracer(fx.proxy.GraphAppendingTracer):
    """Appends a composition's nodes to an existing graph and gives each its fake value
    as it is created, so the composition can read the shapes of its own intermediates
    (the token shard `ceil(T / tp)`, the global T of a PCP step) while being traced.

    `wrap(arg)` turns the graph's nodes in `arg` into `SizedProxy`s. Build it with
    `FakeTracer.for_graph(gm)`; call `drop_unused_sizes()` after the rewrite.
    """

    def __init__(self, graph: fx.Graph, mode: FakeTensorMode) -> None:
        super().__init__(graph)
        self.mode = mode
        # One sym_size node per (tensor node, dim), shared by every read of that size.
        self.sizes: dict[tuple[fx.Node, int], fx.Proxy] = {}

    @classmethod
    def for_graph(cls, gm: fx.GraphModule, reader: str) -> "FakeTracer":
        mode = graph_fake_mode(gm.graph)
        if mode is None:
            raise RuntimeError(f"{reader} reads shapes from fake values and this graph has none "
                               f"(trace it with Dynamo, as the cp_ascend backend receives it)")
        return cls(gm.graph, mode)

    def wrap(self, arg: Any) -> Any:
        return fx.map_arg(arg, lambda n: SizedProxy(n, self))

    def sym_size(self, proxy: fx.Proxy, dim: int) -> fx.Proxy:
        key = (proxy.node, dim)
        if key not in self.sizes:
            self.sizes[key] = self.create_proxy("call_function", torch.ops.aten.sym_size.int, (proxy, dim), {})
        return self.sizes[key]

    def drop_unused_sizes(self) -> None:
        # `a, b, c = x.shape` reads every dim; sizes nothing used are pure and dead.
        for p in self.sizes.values():
            if not p.node.users:
                self.graph.erase_node(p.node)
        self.sizes.clear()

    def proxy(self, node: fx.Node) -> fx.Proxy:
        if VALUE_KEY not in node.meta and "val" not in node.meta and node.op in ("call_function", "call_method"):
            with self.mode, enable_python_dispatcher():
                node.meta[VALUE_KEY] = _run_fake(node)
        return SizedProxy(node, self)


class SizedProxy(fx.Proxy):
    """A proxy that answers `.shape`, `.size()`, `.dim()`, `.dtype` and `.device` from its
    fake value. Static dims are ints; a symbolic dim (the token count) is an
    `aten.sym_size.int` node, so arithmetic on it is recorded in the graph and stays
    valid for every T, never baked in as the traced SymInt."""

    tracer: FakeTracer

    def _fake(self) -> torch.Tensor:
        val = fake_value(self.node)
        if not isinstance(val, torch.Tensor):
            raise RuntimeError(f"node {self.node.name} has no fake tensor value; passes trace on fake values")
        return val

    @property
    def shape(self) -> tuple[Any, ...]:  # type: ignore[override]
        return tuple(int(size) if not isinstance(size, torch.SymInt) or size.node.maybe_as_int() is not None
                     else self.tracer.sym_size(self, d) for d, size in enumerate(self._fake().shape))

    def size(self, dim: int | None = None) -> Any:  # type: ignore[override]
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:  # type: ignore[override]
        return self._fake().dim()

    @property
    def dtype(self) -> torch.dtype:  # type: ignore[override]
        return self._fake().dtype

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._fake().device


_SEGMENT = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")


def parameter_fqn(node: fx.Node) -> str | None:
    """Qualified name of the module parameter a placeholder stands for, else None.

    Dynamo names each parameter placeholder by the attribute path it read, e.g.
    `L['self']._modules['layers']._modules['0']._parameters['weight']` -> 'layers.0.weight'.
    """
    if node.op != "placeholder":
        return None
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    parts = _SEGMENT.findall(source.name)
    return ".".join(parts) if parts else None
