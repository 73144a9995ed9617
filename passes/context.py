"""The compile context: everything a pass may know about one compile, in one value.

The backend builds one `CompileContext` per compiled graph, from the parallel layout
its entry handed it (`Layout`, built by `init_parallel`), the model's `AttentionSpec`
and the roles declared on `@cp_module`, and hands it to the pass pipeline. Passes and the parallel
compositions read only this (or a narrow view of it, such as `cp_view()`), never
module-level parallel state, so a pass can be run and tested in one process on a
context built by hand (`CompileContext.for_test`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from cp_compile.base.config import BATCH_KINDS, DECODE_KINDS, PREFILL_KINDS, AttentionSpec, BatchKind, ConfigError, CPConfig
from cp_compile.base.merge_cost import CollectiveCosts, GroupCollectives
from cp_compile.ops.parallel.dcp import DCPContext
from cp_compile.ops.parallel.dsa_cp import DSACPContext
from cp_compile.ops.parallel.pcp import PCPContext
from cp_compile.base.parallel_layout import Group, Layout

ROLE_NAMES = ("o_proj", "indexer")


class RankGroups(Protocol):
    """What `CompileContext.from_state` reads of an initialised parallel state
    (the front door's `ParallelState`, one layer up, which passes never import)."""

    cfg: CPConfig
    layout: Layout
    collective_costs: CollectiveCosts | None
    device: torch.device  # the device its process groups were built for


@dataclass(frozen=True)
class RoleBinding:
    """A role declared on `@cp_module` (e.g. o_proj="self_attn.o_proj"), resolved.

    modules: qualified names of every submodule the path names (one per layer);
    parameters: qualified names of their parameters, the names
    `passes.fx_utils.parameter_fqn` reads off the graph's parameter placeholders.
    """

    role: str
    path: str
    modules: tuple[str, ...]
    parameters: tuple[str, ...]


def resolve_roles(module: nn.Module, roles: dict[str, str | None]) -> tuple[RoleBinding, ...]:
    """Resolve declared role paths against `module`; a path that names nothing is an error.

    A path matches a submodule whose qualified name equals it or ends with
    "." + path, so "self_attn.o_proj" finds the o_proj of every decoder layer.
    """
    unknown = sorted(set(roles) - set(ROLE_NAMES))
    if unknown:
        raise ValueError(f"cp_module({type(module).__name__}): unknown roles {unknown}. "
                         f"Fix: declare only {list(ROLE_NAMES)}")
    named = dict(module.named_modules())
    out = []
    for role, path in roles.items():
        if path is None:
            continue
        hits = tuple(n for n in named if n == path or n.endswith("." + path))
        if not hits:
            raise ValueError(f"cp_module({type(module).__name__}): role {role}={path!r} names no submodule. "
                             f"Fix: give the attribute path of the {role} module, e.g. 'self_attn.o_proj'")
        params = tuple(f"{m}.{p}" if m else p for m in hits for p, _ in named[m].named_parameters())
        out.append(RoleBinding(role=role, path=path, modules=hits, parameters=params))
    return tuple(out)


@dataclass(frozen=True)
class CompileContext:
    """What one compile is specialised on. Built by the backend; read by the passes.

    Dynamo calls the backend once per new graph (a guard failure or a new batch
    kind compiles again), so every compile builds its own context.
    """

    config: CPConfig
    # This rank's groups (sizes, ranks, names): the one description of the parallel
    # layout (cp_compile/base/parallel_layout.py), handed in by the backend from its entry.
    layout: Layout = field(default_factory=Layout)
    attention: AttentionSpec | None = None
    roles: tuple[RoleBinding, ...] = ()
    # The batches this graph serves: None = every kind (one graph); "decode" /
    # "prefill" when `config.graph_per_batch_kind` splits them, "verify" for speculative
    # verification steps, "fresh_prefill" for PCP prefill steps without cached context
    # (decorator.CompiledForward).
    batch_kind: BatchKind | None = None
    # dcp_merge="auto": the measured collective costs the DCP / PCP passes choose the
    # merge with (cp_compile/base/merge_cost.py); None without init_parallel.
    collective_costs: CollectiveCosts | None = None
    # Collectives over the cp group a pass may issue while compiling (dcp_merge="replicate"
    # gathers the query projection's parameters); None without init_parallel.
    cp_collectives: GroupCollectives | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.batch_kind is not None and self.batch_kind not in BATCH_KINDS:
            raise ConfigError(f"batch_kind is None or one of {BATCH_KINDS}", f"batch_kind={self.batch_kind!r}",
                              f"pass None or one of {', '.join(repr(k) for k in BATCH_KINDS)}")
        self.layout.check(self.config)

    @classmethod
    def from_state(cls, state: RankGroups, attention: AttentionSpec | None = None,
                   roles: tuple[RoleBinding, ...] = (), batch_kind: BatchKind | None = None) -> "CompileContext":
        """The context of a compile on this rank of an initialised parallel state."""
        group = getattr(state, "cp_group", None)
        return cls(config=state.cfg, layout=state.layout, attention=attention, roles=roles, batch_kind=batch_kind,
                   collective_costs=state.collective_costs,
                   cp_collectives=GroupCollectives(group, state.device) if group is not None and state.layout.cp.size > 1 else None)

    @classmethod
    def for_test(cls, config: CPConfig, *, rank: int = 0, attention: AttentionSpec | None = None,
                 roles: tuple[RoleBinding, ...] = (), batch_kind: BatchKind | None = None) -> "CompileContext":
        """A context for graph-structure tests in one process (`Layout.for_test`)."""
        return cls(config=config, layout=Layout.for_test(config, rank), attention=attention, roles=roles,
                   batch_kind=batch_kind)

    @property
    def tp(self) -> Group:
        return self.layout.tp

    @property
    def dcp(self) -> Group:
        return self.layout.dcp

    @property
    def pcp(self) -> Group:
        return self.layout.pcp

    @property
    def cp(self) -> Group:
        """The cache's context-parallel group (pcp * dcp ranks; the DCP group at pcp = 1)."""
        return self.layout.cp

    @property
    def decode_like(self) -> bool:
        """A decode or verify graph: every rank runs the whole batch over the sharded
        cache (no token sharding; at pcp > 1 attention over the pcp * dcp cache ranks)."""
        return self.batch_kind in DECODE_KINDS

    @property
    def prefill_only(self) -> bool:
        """A graph that serves only prefill batches ("prefill", or PCP's "fresh_prefill")."""
        return self.batch_kind in PREFILL_KINDS

    def role(self, name: str) -> RoleBinding | None:
        return next((r for r in self.roles if r.role == name), None)

    def role_of_parameter(self, fqn: str) -> str | None:
        """The role whose module owns parameter `fqn` (a qualified name), if any."""
        return next((r.role for r in self.roles if fqn in r.parameters), None)

    def cp_view(self) -> DCPContext:
        """The view DCP attention runs on: the cache's context-parallel group `cp`. At
        pcp = 1 it is the DCP group; at pcp > 1 decode graphs attend the cache the PCP
        prefill laid out over N = pcp * dcp ranks, so N and the rank are the CP
        group's (docs/pcp.md §5)."""
        cfg = self.config
        return DCPContext(group=self.cp, interleave=cfg.cp_kv_cache_interleave_size, block_size=cfg.block_size,
                          merge=cfg.dcp_merge)

    def pcp_view(self) -> PCPContext:
        """The narrow view the PCP compositions are specialised on: both groups (the
        cache is sharded over pcp * dcp ranks, cp rank = pcp_rank * dcp + dcp_rank)."""
        cfg = self.config
        return PCPContext(pcp=self.pcp, dcp=self.dcp, cp=self.cp, interleave=cfg.cp_kv_cache_interleave_size,
                          block_size=cfg.block_size, merge=cfg.dcp_merge, fresh=self.batch_kind == "fresh_prefill")

    def tp_view(self) -> DSACPContext:
        """The narrow view the DSA-CP compositions are specialised on: the TP group,
        over which the indexer's and sparse attention's queries are token-sharded."""
        return DSACPContext(tp=self.tp)

    def describe(self) -> str:
        """One line for error messages."""
        cfg = self.config
        kind = self.attention.kind if self.attention is not None else "unknown"
        return (f"tensor_parallel_size={cfg.tensor_parallel_size}, "
                f"decode_context_parallel_size={cfg.decode_context_parallel_size}, "
                f"prefill_context_parallel_size={cfg.prefill_context_parallel_size}, enable_dsa_cp={cfg.enable_dsa_cp}, "
                f"attention kind={kind}, batch kind={self.batch_kind or 'any'}")

