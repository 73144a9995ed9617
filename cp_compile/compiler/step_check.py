"""Per-step validation of a graph compiled by the cp_ascend backend (issue 19).

`torch.compile(model, backend="cp_ascend")` hands the backend a Dynamo graph whose
inputs are flat tensors: Dynamo has already taken the `AttentionMetadata` apart, and
the model's own eager `validate_step` call is skipped while compiling. The backend
still knows, at compile time, which placeholders are the metadata fields and the
caches: they are the arguments, by schema name, of the `cp::` ops that write a cache
(`slot_mapping`, `block_table`, `seq_lens`, `query_start_loc`; the cache arguments
are the ones the schema marks as written). `StepCheck` records their placeholder
indices once and, on every call of the compiled graph, rebuilds the global metadata
from the call's inputs and runs `validate_step` on it: on the host, before the graph
runs, so bad metadata is refused before any cache write, with the same verdict on
every rank (the metadata is global). One host sync per metadata per call, none per
op. `CompiledForward` (`compile_model`, `@cp_module`) validates at its own entry with
the unflattened arguments and turns this off for its backends.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from cp_compile.runtime.metadata import AttentionMetadata
from cp_compile.runtime.metadata_checks import validate_step

# The metadata fields a cp:: op may take, by schema argument name. positions is
# checked when an op reads it as a graph input (no attention op does today).
_FIELDS = ("query_start_loc", "seq_lens", "block_table", "slot_mapping", "positions")
_REQUIRED = ("query_start_loc", "seq_lens", "block_table", "slot_mapping")
# Its cache is the replicated index cache under SFA DCP (pages of whole virtual
# blocks): checked by the op itself, not part of the step's cache geometry.
_OWN_GEOMETRY = ("cp::lightning_indexer",)


def _schema(target: Any) -> torch._C.FunctionSchema | None:
    """The schema of a `cp::` op node's target (Dynamo graphs call the packet)."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        target = target.default
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "cp":
        return target._schema
    return None


def _bound(node: fx.Node, schema: torch._C.FunctionSchema) -> dict[str, Any]:
    named = dict(zip((a.name for a in schema.arguments), node.args))
    named.update(node.kwargs)
    return named


def written_caches(gm: fx.GraphModule) -> list[tuple[str, int]]:
    """(cp op name, placeholder index) of every graph input a `cp::` op writes (its caches)."""
    index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    out = []
    for node in gm.graph.nodes:
        schema = _schema(node.target) if node.op == "call_function" else None
        if schema is None:
            continue
        args = _bound(node, schema)
        out += [(schema.name, index[args[a.name]]) for a in schema.arguments
                if a.alias_info is not None and a.alias_info.is_write and args.get(a.name) in index]
    return out


@dataclass(frozen=True)
class _Group:
    """One metadata (placeholder index per field) and the caches its ops write."""

    fields: tuple[tuple[str, int], ...]
    layers: tuple[tuple[int, ...], ...]  # per op node: the placeholder indices of its caches


class StepCheck:
    """Validates each call's metadata against its caches (see the module docstring).

    Built from the Dynamo graph before any pass rewrites it (the single-device ops
    still name their inputs); `bind` maps the recorded placeholder nodes to their
    indices in the graph that is finally lowered.
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        placeholders = {n for n in gm.graph.nodes if n.op == "placeholder"}
        groups: dict[tuple[tuple[str, fx.Node], ...], list[tuple[fx.Node, ...]]] = {}
        unchecked: list[str] = []
        for node in gm.graph.nodes:
            schema = _schema(node.target) if node.op == "call_function" else None
            if schema is None:
                continue
            args = _bound(node, schema)
            caches = tuple(args[a.name] for a in schema.arguments
                           if a.alias_info is not None and a.alias_info.is_write and args.get(a.name) is not None)
            if not caches:
                continue  # writes no cache: nothing a bad slot could corrupt
            fields = tuple((f, args[f]) for f in _FIELDS if args.get(f) in placeholders)
            if any(f not in dict(fields) for f in _REQUIRED) or any(c not in placeholders for c in caches):
                unchecked.append(f"{node.name} ({schema.name})")
                continue
            layers = groups.setdefault(fields, [])
            if schema.name not in _OWN_GEOMETRY:
                layers.append(caches)
        self._nodes = groups
        self.groups: tuple[_Group, ...] = ()
        self.cp = 1  # set by bind: the compile context's pcp * dcp
        self.unchecked = tuple(unchecked)

    def bind(self, gm: fx.GraphModule, cp: int) -> None:
        """Record the placeholder indices in `gm` (the graph after the passes) and the
        cache's context-parallel size `cp` (pcp * dcp) of the compile context, which
        the check validates at (virtual blocks of block_size * cp)."""
        self.cp = cp
        index = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
        self.groups = tuple(_Group(fields=tuple((f, index[n]) for f, n in fields),
                                   layers=tuple(tuple(index[c] for c in layer) for layer in layers))
                            for fields, layers in self._nodes.items() if layers)
        if self.unchecked:
            # Never silently nothing (issue 19): these cache writes run unchecked.
            warnings.warn(
                f"cp_ascend: the cache writes of {', '.join(self.unchecked)} read metadata or caches computed "
                "inside the graph, so the backend cannot check them per step. Fix: pass the AttentionMetadata "
                "fields and the caches as inputs of the compiled function (as the example models do), or "
                "compile with cp_compile.compile_model, which validates at its entry", stacklevel=2)

    def __call__(self, args: Sequence[Any]) -> None:
        for g in self.groups:
            values = {f: args[i] for f, i in g.fields}
            meta = AttentionMetadata(query_start_loc=values["query_start_loc"], seq_lens=values["seq_lens"],
                                     block_table=values["block_table"], slot_mapping=values["slot_mapping"],
                                     positions=values.get("positions"))  # type: ignore[arg-type]
            validate_step(meta, [tuple(args[i] for i in layer) for layer in g.layers], cp=self.cp)


def checked(compiled: Callable[..., Any], check: StepCheck) -> Callable[..., Any]:
    """`compiled`, calling `check` on its inputs first. Dynamo calls a backend's
    callable with the graph inputs as positional arguments (AOTAutograd's and
    Inductor's entry points too; their `_boxed_call` attribute is `functools.wraps`
    copying the inner function's, so it is not copied here)."""

    def run(*args: Any) -> Any:
        check(args)
        return compiled(*args)

    return run
