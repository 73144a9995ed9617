"""The compile context: everything a pass may know about one compile, in one value.

The backend builds one `CompileContext` per compiled graph, from the parallel state
(`init_parallel`), the model's `AttentionSpec` and the roles declared on
`@cp_module`, and hands it to the pass pipeline. Passes and the parallel
compositions read only this (or a narrow view of it, such as `cp_view()`), never
module-level parallel state, so a pass can be run and tested in one process on a
context built by hand (`CompileContext.for_test`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import nn

from cp_compile.config import DECODE_KINDS, AttentionSpec, BatchKind, ConfigError, CPConfig
from cp_compile.merge_cost import CollectiveCosts
from cp_compile.ops.parallel.dcp import DCPContext
from cp_compile.ops.parallel.dsa_cp import DSACPContext
from cp_compile.ops.parallel.pcp import PCPContext

ROLE_NAMES = ("o_proj", "indexer")


class _NamedGroup(Protocol):
    group_name: str  # what functional collectives address a process group by


class RankGroups(Protocol):
    """What `CompileContext.from_state` reads of an initialised parallel state
    (the front door's `ParallelState`, one layer up, which passes never import)."""

    cfg: CPConfig
    tp_rank: int
    dcp_rank: int
    pcp_rank: int
    cp_rank: int
    tp_group: _NamedGroup
    dcp_group: _NamedGroup
    pcp_group: _NamedGroup

    @property
    def cp_group_name(self) -> str: ...


@dataclass(frozen=True)
class GroupInfo:
    """One process group as the graph sees it: its size, this rank's place in it, and
    the name functional collectives address it by ("" when there is no group)."""

    size: int = 1
    rank: int = 0
    name: str = ""


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
    tp: GroupInfo = field(default_factory=GroupInfo)
    dcp: GroupInfo = field(default_factory=GroupInfo)
    pcp: GroupInfo = field(default_factory=GroupInfo)
    # The pcp * dcp ranks sharing this rank's KV heads; rank = pcp_rank * dcp + dcp_rank
    # (docs/pcp.md §2). At pcp = 1 the DCP group; left default, it is filled from
    # `dcp` / `pcp` when one of them is 1 (a hand-built context needs it only at both > 1).
    cp: GroupInfo | None = None
    attention: AttentionSpec | None = None
    roles: tuple[RoleBinding, ...] = ()
    # The batches this graph serves: None = every kind (one graph); "decode" /
    # "prefill" when `config.graph_per_batch_kind` splits them, "verify" for speculative
    # verification steps (decorator.CompiledForward).
    batch_kind: BatchKind | None = None
    # dcp_merge="auto": the measured collective costs the DCP / PCP passes choose the
    # merge with (cp_compile/merge_cost.py); None without init_parallel.
    collective_costs: CollectiveCosts | None = None

    def __post_init__(self) -> None:
        if self.batch_kind not in (None, "decode", "prefill", "verify"):
            raise ConfigError("batch_kind is None, 'decode', 'prefill' or 'verify'",
                              f"batch_kind={self.batch_kind!r}", "pass one of None, 'decode', 'prefill', 'verify'")
        if self.cp is None:
            # Same ranks as the DCP group (pcp = 1) or the PCP group (dcp = 1).
            cp = self.dcp if self.pcp.size == 1 else self.pcp if self.dcp.size == 1 else GroupInfo()
            object.__setattr__(self, "cp", cp)
        cfg = self.config
        for name, g, want in (("tp", self.tp, cfg.tensor_parallel_size), ("dcp", self.dcp, cfg.decode_context_parallel_size),
                              ("pcp", self.pcp, cfg.prefill_context_parallel_size),
                              ("cp", self.cp, self.config.context_parallel_size)):
            if g.size != want or not 0 <= g.rank < g.size:
                raise ConfigError(f"{name} group matches the config",
                                  f"{name} group size={g.size} rank={g.rank}, config {name}={want}",
                                  "build the context from the same CPConfig as init_parallel")
            if g.size > 1 and not g.name:
                raise ConfigError(f"{name} group has a name", f"{name} size={g.size} with no group name",
                                  "pass the process group's group_name")

    @classmethod
    def from_state(cls, state: RankGroups, attention: AttentionSpec | None = None,
                   roles: tuple[RoleBinding, ...] = (), batch_kind: BatchKind | None = None) -> "CompileContext":
        """The context of a compile on this rank of an initialised parallel state."""
        cfg = state.cfg
        return cls(config=cfg,
                   tp=GroupInfo(cfg.tensor_parallel_size, state.tp_rank, state.tp_group.group_name),
                   dcp=GroupInfo(cfg.decode_context_parallel_size, state.dcp_rank, state.dcp_group.group_name),
                   pcp=GroupInfo(cfg.prefill_context_parallel_size, state.pcp_rank, state.pcp_group.group_name),
                   cp=GroupInfo(cfg.context_parallel_size, state.cp_rank, state.cp_group_name),
                   attention=attention, roles=roles, batch_kind=batch_kind,
                   collective_costs=getattr(state, "collective_costs", None))

    @classmethod
    def for_test(cls, config: CPConfig, *, rank: int = 0, attention: AttentionSpec | None = None,
                 roles: tuple[RoleBinding, ...] = (), batch_kind: BatchKind | None = None) -> "CompileContext":
        """A context for graph-structure tests in one process: group names are
        placeholders no collective ever resolves (the graph is inspected, not run)."""
        def grp(kind: str, size: int) -> GroupInfo:
            return GroupInfo(size, rank % size, f"test_{kind}" if size > 1 else "")

        dcp, pcp = grp("dcp", config.decode_context_parallel_size), grp("pcp", config.prefill_context_parallel_size)
        cp = None
        if dcp.size > 1 and pcp.size > 1:
            cp = GroupInfo(config.context_parallel_size, pcp.rank * dcp.size + dcp.rank, "test_cp")
        return cls(config=config, tp=grp("tp", config.tensor_parallel_size), dcp=dcp, pcp=pcp, cp=cp,
                   attention=attention, roles=roles, batch_kind=batch_kind)

    @property
    def decode_like(self) -> bool:
        """A decode or verify graph: every rank runs the whole batch over the sharded
        cache (no token sharding; at pcp > 1 attention over the pcp * dcp cache ranks)."""
        return self.batch_kind in DECODE_KINDS

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
        cp = self.cp
        assert cp is not None  # filled by __post_init__
        return DCPContext(size=cp.size, rank=cp.rank, interleave=cfg.cp_kv_cache_interleave_size,
                          block_size=cfg.block_size, group_name=cp.name, merge=cfg.dcp_merge)

    def pcp_view(self) -> PCPContext:
        """The narrow view the PCP compositions are specialised on: both groups (the
        cache is sharded over pcp * dcp ranks, cp rank = pcp_rank * dcp + dcp_rank)."""
        cfg = self.config
        return PCPContext(pcp=self.pcp.size, pcp_rank=self.pcp.rank, pcp_group_name=self.pcp.name,
                          dcp=self.dcp.size, dcp_rank=self.dcp.rank, dcp_group_name=self.dcp.name,
                          interleave=cfg.cp_kv_cache_interleave_size, block_size=cfg.block_size, merge=cfg.dcp_merge)

    def tp_view(self) -> DSACPContext:
        """The narrow view the DSA-CP compositions are specialised on: the TP group,
        over which the indexer's and sparse attention's queries are token-sharded."""
        return DSACPContext(tp=self.tp.size, rank=self.tp.rank, group_name=self.tp.name)

    def describe(self) -> str:
        """One line for error messages."""
        cfg = self.config
        kind = self.attention.kind if self.attention is not None else "unknown"
        return (f"tensor_parallel_size={cfg.tensor_parallel_size}, "
                f"decode_context_parallel_size={cfg.decode_context_parallel_size}, "
                f"prefill_context_parallel_size={cfg.prefill_context_parallel_size}, enable_dsa_cp={cfg.enable_dsa_cp}, "
                f"attention kind={kind}, batch kind={self.batch_kind or 'any'}")

