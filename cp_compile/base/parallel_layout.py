"""The parallel layout: one value for the groups a rank takes part in (issue 20).

`Layout` says, for this rank, each group's size, this rank's place in it and the
name functional collectives address it by: TP, DCP (runs of `dcp` ranks inside a
TP group), PCP (same TP rank across TP groups) and `cp`, the cache's
context-parallel group (the pcp * dcp ranks sharing this rank's KV heads, rank
`pcp_rank * dcp + dcp_rank`, docs/pcp.md §2). It holds no process group and reads
no global: `init_parallel` builds it next to the live groups (`ParallelState.layout`),
the compile entries hand it to the backend, the backend into `CompileContext.layout`,
and the compositions' contexts (`CompileContext.cp_view()` / `pcp_view()` /
`tp_view()`) are views of it. Base layer: it imports nothing of the project above config.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cp_compile.base.config import ConfigError, CPConfig


@dataclass(frozen=True)
class Group:
    """One process group as the graph sees it: its size, this rank's place in it, and
    the name functional collectives address it by ("" when there is no group)."""

    size: int = 1
    rank: int = 0
    name: str = ""


@dataclass(frozen=True)
class Layout:
    """This rank's TP / DCP / PCP / cp groups (module docstring).

    `cp` left None is filled from `dcp` (pcp = 1) or `pcp` (dcp = 1), the same ranks;
    at dcp > 1 and pcp > 1 it must be given (a group of its own).
    """

    tp: Group = field(default_factory=Group)
    dcp: Group = field(default_factory=Group)
    pcp: Group = field(default_factory=Group)
    cp: Group = None  # type: ignore[assignment]  # filled by __post_init__

    def __post_init__(self) -> None:
        if self.cp is None:
            if self.dcp.size > 1 and self.pcp.size > 1:
                raise ConfigError("Layout.cp is given at dcp > 1 and pcp > 1",
                                  f"dcp size={self.dcp.size}, pcp size={self.pcp.size}, cp=None",
                                  "pass cp=Group(pcp * dcp, pcp_rank * dcp + dcp_rank, <cp group name>)")
            object.__setattr__(self, "cp", self.dcp if self.pcp.size == 1 else self.pcp)

    def groups(self) -> dict[str, Group]:
        return {"tp": self.tp, "dcp": self.dcp, "pcp": self.pcp, "cp": self.cp}

    def check(self, config: CPConfig) -> None:
        """ConfigError unless every group has the config's size, a rank inside it, and a
        name when it has more than one rank."""
        want = {"tp": config.tensor_parallel_size, "dcp": config.decode_context_parallel_size,
                "pcp": config.prefill_context_parallel_size, "cp": config.context_parallel_size}
        for name, g in self.groups().items():
            if g.size != want[name] or not 0 <= g.rank < g.size:
                raise ConfigError(f"{name} group matches the config",
                                  f"{name} group size={g.size} rank={g.rank}, config {name}={want[name]}",
                                  "build the layout from the same CPConfig as init_parallel")
            if g.size > 1 and not g.name:
                raise ConfigError(f"{name} group has a name", f"{name} size={g.size} with no group name",
                                  "pass the process group's group_name")

    @classmethod
    def for_test(cls, config: CPConfig, rank: int = 0) -> "Layout":
        """A layout for graph-structure tests in one process: group names are
        placeholders no collective ever resolves (the graph is inspected, not run)."""
        def grp(kind: str, size: int) -> Group:
            return Group(size, rank % size, f"test_{kind}" if size > 1 else "")

        dcp, pcp = grp("dcp", config.decode_context_parallel_size), grp("pcp", config.prefill_context_parallel_size)
        cp = None
        if dcp.size > 1 and pcp.size > 1:
            cp = Group(config.context_parallel_size, pcp.rank * dcp.size + dcp.rank, "test_cp")
        return cls(tp=grp("tp", config.tensor_parallel_size), dcp=dcp, pcp=pcp, cp=cp)  # type: ignore[arg-type]
