"""Base class of cp-compile FX passes."""

from __future__ import annotations

import abc
from typing import ClassVar

import torch
import torch.fx as fx

from cp_compile.passes.context import CompileContext


class CPPass(abc.ABC):
    """A graph-to-graph rewrite on the Dynamo FX graph (before AOTAutograd).

    A pass is built from the `CompileContext` of one compile and reads nothing else.
    Passes carry no cache key: the custom backend is called by Dynamo for every new
    graph and nothing caches a pass's output across contexts (docs/decisions.md 15).
    """

    name: ClassVar[str]
    # Single-device ops this pass replaces (or claims) when enabled; the final
    # unsharded-attention check cites them to say what supports an op.
    handles: ClassVar[tuple[torch._ops.OpOverloadPacket, ...]] = ()
    # When the pipeline enables the pass, in words (for error messages and docs).
    enabled_when: ClassVar[str]

    def __init__(self, ctx: CompileContext) -> None:
        self.ctx = ctx

    @classmethod
    @abc.abstractmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        """Whether the pipeline runs this pass for `ctx` (see `enabled_when`)."""

    @abc.abstractmethod
    def __call__(self, gm: fx.GraphModule) -> int:
        """Rewrite `gm` in place; return the number of rewrites made."""
