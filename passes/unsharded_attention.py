"""Final check: no single-device attention op survives the pipeline under DCP / PCP.

A single-device attention op assumes the whole KV cache of one device. Left in a
graph whose cache is sharded (dcp > 1) or whose tokens are split (pcp > 1), it would
attend a fraction of the tokens and return a wrong answer with no error: the worst
kind of bug. This pass runs last and turns that into a compile-time `ConfigError`
naming the op, the config and the passes that support the op.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from cp_compile.base.config import ConfigError
from cp_compile.passes.context import CompileContext
from cp_compile.ops.core.catalog import SINGLE_DEVICE_ATTENTION_OPS
from cp_compile.passes.base import CPPass
from cp_compile.passes.fx_utils import CLAIMED_KEY, op_nodes
from cp_compile.passes.rewrites import REWRITES


def supported_by(op: torch._ops.OpOverloadPacket) -> str:
    """Which pipeline passes handle `op`, and when they run, in words."""
    names = [f"the {p.name} pass (enabled when {p.enabled_when})" for p in REWRITES if op in p.handles]
    if not names:
        return "no pass supports it yet, so this model runs only at decode_context_parallel_size=1 and " \
               "prefill_context_parallel_size=1"
    return "it is supported by " + " and ".join(names)


class UnshardedAttentionCheck(CPPass):
    """Refuse a graph that still holds a single-device attention op (see module docstring)."""

    name = "unsharded_attention_check"
    enabled_when = "decode_context_parallel_size > 1 or prefill_context_parallel_size > 1"

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        return ctx.dcp.size > 1 or ctx.pcp.size > 1

    def __call__(self, gm: fx.GraphModule) -> int:
        for op in SINGLE_DEVICE_ATTENTION_OPS:
            left = [n for n in op_nodes(gm, (op,)) if CLAIMED_KEY not in n.meta]
            if left:
                raise ConfigError(
                    "every single-device attention op is rewritten under DCP / PCP",
                    f"{len(left)} node(s) of {op._qualified_op_name} left in the graph (first: {left[0].name}) "
                    f"with {self.ctx.describe()}; {supported_by(op)}",
                    "run this model at decode_context_parallel_size=1 and prefill_context_parallel_size=1, "
                    "or use an attention op a pass supports")
        return 0
