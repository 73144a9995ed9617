"""Query replication for `dcp_merge="replicate"` (issue 26, decision 49; Helix-style).

Under DCP each rank of the group computes its own query heads, so the DCP attention
gathers the group's queries (one all-gather per layer) before the partial attention.
With "replicate" every rank computes the queries of all N ranks itself and the layer's
only collective is the merge's all-to-all.

In the single-device graph the queries of an attention node come out of a subgraph
the keys, values and metadata do not use (the query chain: q projection, q norm,
RoPE, MLA's W_UK absorption, ...). Every rank runs that chain N times, once with each
group rank's parameters, and concatenates the heads in group rank order: exactly the
tensor `all_gather_heads` would have given. The other ranks' parameters are gathered
once, at compile time (a collective inside the compile: every rank of the group
compiles the same graphs, as they must for the graph's own collectives), and held by
the graph as buffers: the memory of N - 1 more query projections per layer, and a
snapshot: parameters changed after the compile are not seen by the copies.

Refused (`NotReplicable`, the reason kept in the pass history; "auto" then leaves
replicate out, an explicit "replicate" is a `ConfigError`) where the copy would not be
exact or cannot be built:
- a value the chain reads from outside it that may differ across the group: a cache,
  a parameter that differs between ranks, or anything computed from one that no
  all-reduce / all-gather made identical (e.g. a fused QKV projection: the q heads
  come out of a node the keys share, and its other ranks' weights are needed);
- a chain leaf that is not a parameter (a graph input only the queries read);
- collectives or in-place ops inside the chain; a graph without Dynamo's real
  parameter values (`grapharg`), e.g. one built by hand in a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.fx as fx
from torch import nn
from torch._dynamo.source import ConstantSource

from cp_compile.base.merge_cost import GroupCollectives, QueryWeights
from cp_compile.passes.fx_utils import VALUE_KEY, fake_value, graph_fake_mode

_c10d = torch.ops._c10d_functional
# Outputs identical on every rank of a group that contains the DCP group (TP's
# all-reduce; DCP runs inside TP), so what is computed from them is too.
_REPLICATING = {_c10d.all_reduce, _c10d.all_reduce.default, _c10d.all_gather_into_tensor,
                _c10d.all_gather_into_tensor.default}
_WAIT = {_c10d.wait_tensor, _c10d.wait_tensor.default}  # Dynamo's graphs hold the packets, passes the overloads


class NotReplicable(Exception):
    """The graph's queries cannot be replicated exactly; str(self) says why."""


@dataclass(frozen=True)
class QueryChain:
    nodes: tuple[fx.Node, ...]  # the chain's compute nodes, graph order
    leaves: tuple[fx.Node, ...]  # parameter placeholders only the chain reads
    outputs: tuple[fx.Node, ...]  # the attention node's query arguments
    weights: QueryWeights


def _ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack.extend(n.all_input_nodes)
    return seen


def _real(node: fx.Node) -> torch.Tensor | None:
    """The real tensor behind a parameter placeholder / get_attr (None: not a parameter)."""
    if node.op == "get_attr":
        t = getattr(node.graph.owning_module, str(node.target), None)
        return t if isinstance(t, torch.Tensor) else None
    example = getattr(node.meta.get("grapharg"), "example", None)
    return example if isinstance(example, nn.Parameter) else None


parameter_value = _real  # public name: project-before-merge gathers a projection's weights the same way


def _is_collective(node: fx.Node) -> bool:
    return node.op == "call_function" and "_c10d_functional" in str(node.target)


def _mutates(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def query_chain(graph: fx.Graph, queries: tuple[fx.Node, ...], others: Iterable[fx.Node]) -> QueryChain:
    """The nodes only the `queries` of one attention node depend on (the rest of its
    arguments: `others`). Raises NotReplicable."""
    shared = _ancestors(others)
    # Size placeholders (symbolic ints: token counts) are the same on every rank; the copies read them.
    mine = {n for n in _ancestors(queries) - shared
            if not (n.op == "placeholder" and not isinstance(fake_value(n), torch.Tensor))}
    order = [n for n in graph.nodes if n in mine]
    leaves = tuple(n for n in order if n.op in ("placeholder", "get_attr"))
    nodes = tuple(n for n in order if n.op not in ("placeholder", "get_attr"))
    if not nodes:
        raise NotReplicable("nothing computes the queries alone: they are a graph input, or the keys / values "
                            "are computed from them (e.g. sliced out of one fused projection)")
    for n in nodes:
        if n.op == "call_module":
            raise NotReplicable(f"{n.name} calls a submodule (not inlined)")
        if _is_collective(n) or _mutates(n):
            raise NotReplicable(f"{n.format_node()} is a collective / in-place op inside the query chain")
    for leaf in leaves:
        if _real(leaf) is None:
            raise NotReplicable(f"{leaf.name} (read only by the queries) is not a parameter with a real value "
                                "in the graph")
    if not leaves:
        raise NotReplicable("the query chain reads no parameter of its own (e.g. a fused QKV projection: "
                            "the queries come out of a node the keys share)")
    params = [_real(leaf) for leaf in leaves]
    weights = QueryWeights(bytes=sum(p.numel() * p.element_size() for p in params),
                           matrix_elements=sum(p.numel() for p in params if p.dim() == 2))
    return QueryChain(nodes, leaves, tuple(queries), weights)


def _reads_from_outside(chain: QueryChain) -> list[fx.Node]:
    inside = set(chain.nodes) | set(chain.leaves)
    return list(dict.fromkeys(a for n in chain.nodes for a in n.all_input_nodes if a not in inside))


def _rank_dependent_parameters(nodes: list[fx.Node], caches: set[fx.Node]) -> tuple[list[fx.Node], str | None]:
    """Parameters the `nodes` are computed from without a replicating collective between,
    and the reason they are not replicated for sure (a cache reached), else None."""
    params: list[fx.Node] = []
    seen: set[fx.Node] = set()
    via: dict[fx.Node, fx.Node] = {}
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n in caches:
            path = [n]
            while path[-1] in via:
                path.append(via[path[-1]])
            return params, (f"the query chain reads {n.name}, a rank's cache shard (via "
                            f"{' <- '.join(p.name for p in path[:8])})")
        if n.op == "call_function" and n.target in _WAIT:
            src = n.args[0]
            if isinstance(src, fx.Node) and src.target in _REPLICATING:
                continue  # identical on every rank of the group
        if n.op in ("placeholder", "get_attr"):
            if _real(n) is not None:
                params.append(n)
            continue  # other graph inputs: global metadata, token ids, positions (identical by contract)
        for a in n.all_input_nodes:
            via.setdefault(a, n)
            stack.append(a)
    return params, None


def _checksums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[P, 3] float64: numel, sum and a position-weighted sum of each tensor."""
    rows = []
    for t in tensors:
        x = t.detach().reshape(-1).double()
        w = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device) / max(x.numel(), 1)
        rows.append(torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64, device=x.device),
                                 x.sum(), (x * w).sum()]))
    return torch.stack(rows) if rows else torch.zeros(0, 3, dtype=torch.float64, device="cpu")


def check_replicated_inputs(chain: QueryChain, caches: set[fx.Node], group: GroupCollectives) -> None:
    """Every value the chain reads from outside must be identical across the group
    (collective: every rank of the group calls it). Raises NotReplicable."""
    params, why = _rank_dependent_parameters(_reads_from_outside(chain), caches)
    flag = torch.tensor([0.0 if why is None else 1.0], dtype=torch.float64, device=group.device)
    sums = _checksums([_real(p) for p in params]).to(group.device)  # where the group's collectives run
    # Every rank: the same verdict (a rank that cannot build the copies must not leave the others waiting).
    group.all_reduce(flag, "max")
    if flag.item() > 0:
        raise NotReplicable(why or "another rank of the group found the query chain not replicable")
    if sums.numel():
        lo, hi = group.all_reduce(sums.clone(), "min"), group.all_reduce(sums.clone(), "max")
        differ = [p.name for p, row in zip(params, (hi - lo).abs().amax(dim=1).tolist()) if row > 0]
        if differ:
            raise NotReplicable(f"the query chain reads {differ[0]} (via values the keys share), which differs "
                                "across the group: its other ranks' values would be needed (e.g. a fused QKV "
                                "projection)")


def _declare_to_aot(gm: fx.GraphModule, name: str) -> None:
    """aot_autograd lifts a Dynamo graph's buffers as inputs and looks each up in the
    graph's `_param_name_to_source` (for its dedup guards): declare the buffer a constant
    of the compile (it is one: a snapshot taken now, never an argument of the frame)."""
    table = getattr(gm, "_param_name_to_source", None)
    if table is not None:
        table[name] = ConstantSource(name)


def constant_buffer(gm: fx.GraphModule, name: str, value: torch.Tensor, *, static_shapes: bool = False) -> fx.Node:
    """`value` held by the graph as a buffer (a compile-time snapshot, declared to aot_autograd),
    read by a get_attr node inserted at the graph's insertion point, with its fake value.
    static_shapes: fixed sizes, for a value whose fresh size symbols would have no source in
    the frame (a guard on one breaks Dynamo's guard building)."""
    gm.register_buffer(name, value)
    _declare_to_aot(gm, name)
    node = gm.graph.get_attr(name)
    mode = graph_fake_mode(gm.graph)
    if mode is not None:
        node.meta[VALUE_KEY] = mode.from_tensor(value, static_shapes=True) if static_shapes else mode.from_tensor(value)
    return node


def replicate_queries(gm: fx.GraphModule, attention: fx.Node, chain: QueryChain, rank: int,
                      group: GroupCollectives) -> tuple[fx.Node, ...]:
    """Insert the N copies of `chain` before `attention` and return, per query output,
    the node of the group's queries [T, N*H, ...] (heads in group rank order)."""
    size = group.size
    params = [group.all_gather(_real(leaf)) for leaf in chain.leaves]  # [leaf][group rank] (collective)
    graph = gm.graph
    mode = graph_fake_mode(graph)
    per_rank: list[tuple[fx.Node, ...]] = []
    with graph.inserting_before(attention):
        for r in range(size):
            if r == rank:
                per_rank.append(chain.outputs)
                continue
            env: dict[fx.Node, fx.Node] = {}
            for i, leaf in enumerate(chain.leaves):
                env[leaf] = constant_buffer(gm, f"_cp_replicated_q_{attention.name}_{i}_rank{r}", params[i][r])
            for n in chain.nodes:
                env[n] = graph.node_copy(n, lambda a: env.get(a, a))
            per_rank.append(tuple(env[q] for q in chain.outputs))
        outs = []
        for j in range(len(chain.outputs)):
            parts = [per_rank[r][j] for r in range(size)]
            cat = graph.call_function(torch.cat, (parts, 1))
            if mode is not None:
                with mode:
                    cat.meta[VALUE_KEY] = torch.cat([fake_value(p) for p in parts], 1)
            outs.append(cat)
    return tuple(outs)
