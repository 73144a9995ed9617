"""Base class of cp-compile FX passes."""

from __future__ import annotations

import abc
import hashlib
import importlib
import inspect
import sys
from typing import Any, ClassVar

import torch
import torch.fx as fx

from cp_compile.passes.context import CompileContext


class CPPass(abc.ABC):
    """A graph-to-graph rewrite on the Dynamo FX graph (before AOTAutograd).

    A pass is built from the `CompileContext` of one compile and reads nothing else.
    `uuid()` hashes the pass's own source, the source of the modules whose code it
    emits into graphs (`emits_from`), and `config_values()`, so it changes whenever
    the pass could produce a different graph and compile caches never serve a
    stale one.
    """

    name: ClassVar[str]
    # Single-device ops this pass replaces (or claims) when enabled; the final
    # unsharded-attention check cites them to say what supports an op.
    handles: ClassVar[tuple[torch._ops.OpOverloadPacket, ...]] = ()
    # When the pipeline enables the pass, in words (for error messages and docs).
    enabled_when: ClassVar[str]
    # Modules whose functions the pass traces into the graph (its compositions).
    emits_from: ClassVar[tuple[str, ...]] = ()

    def __init__(self, ctx: CompileContext) -> None:
        self.ctx = ctx

    @classmethod
    @abc.abstractmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        """Whether the pipeline runs this pass for `ctx` (see `enabled_when`)."""

    @abc.abstractmethod
    def __call__(self, gm: fx.GraphModule) -> int:
        """Rewrite `gm` in place; return the number of rewrites made."""

    def config_values(self) -> dict[str, Any]:
        """Every setting the pass reads from the context (part of the uuid)."""
        return {}

    def uuid(self) -> str:
        h = hashlib.sha256()
        # Every module of the pass's class hierarchy (a subclass reuses its parent's
        # rewrite loop), then the compositions it emits.
        hierarchy = [c.__module__ for c in type(self).__mro__ if issubclass(c, CPPass) and c is not CPPass]
        for mod in dict.fromkeys([*hierarchy, *self.emits_from]):
            module = sys.modules.get(mod) or importlib.import_module(mod)
            h.update(inspect.getsource(module).encode())
        h.update(repr(sorted(self.config_values().items())).encode())
        return h.hexdigest()
