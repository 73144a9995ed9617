"""FX helpers shared by the passes: op histograms, shaped proxies, fake values.

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
from torch._subclasses.fake_tensor import FakeTensor

VALUE_KEY = "example_value"  # Dynamo's key for a node's fake value
# A pass that keeps a single-device op as it is, because it is exact under the
# context's layout (e.g. the indexer over its replicated cache under SFA DCP), marks
# the node with its name here; the unsharded-attention check accepts marked nodes.
CLAIMED_KEY = "cp_claimed_by"


def fake_value(node: fx.Node) -> Any:
    return node.meta.get(VALUE_KEY, node.meta.get("val"))


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


def propagate_fake_values(gm: fx.GraphModule) -> int:
    """Give every call node without a fake value one, by running it on fake inputs.

    Runs in graph order under the fake mode of the graph's values (so symbolic sizes
    stay symbolic). Returns the number of nodes filled in; a graph with no fake values
    at all (not traced by Dynamo) is left alone.
    """
    # The mode of the graph's own values, not `detect_fake_mode`: inside a backend
    # call the tracing context holds a fresh fake mode that the graph's values do not
    # belong to, and fake tensors of two modes cannot meet in one op.
    mode = next((v.fake_mode for v in map(fake_value, gm.graph.nodes) if isinstance(v, FakeTensor)), None)
    if mode is None:
        return 0
    filled = 0
    with mode:
        for n in gm.graph.nodes:
            # Presence, not truth: ops that return None (cache writes) have a value of None.
            if n.op not in ("call_function", "call_method") or VALUE_KEY in n.meta or "val" in n.meta:
                continue
            args, kwargs = fx.map_arg((n.args, n.kwargs), fake_value)
            if n.op == "call_function":
                val = n.target(*args, **kwargs)
            else:
                val = getattr(args[0], n.target)(*args[1:], **kwargs)
            n.meta[VALUE_KEY] = val
            filled += 1
    return filled


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
