"""The `cp_ascend` torch.compile backend.

`torch.compile(model, backend="cp_ascend")` finds `cp_ascend` below through the
`torch_dynamo_backends` entry point, so the name works without importing
cp_compile. It reads the parallel state set up by `cp_compile.init_parallel`,
runs the passes on the Dynamo graph (before AOTAutograd, so every lowering sees
them) and lowers the result. `cp_compile.backend(...)` builds one explicitly.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx

import cp_compile.ops  # noqa: F401  (registers cp::* ops before any graph is traced)
from cp_compile.config import ConfigError, CPConfig
from cp_compile.lowering import Lowering, TorchairMode, lower
from cp_compile.ops.dcp_attention import DCPContext
from cp_compile.parallel_state import parallel_state_or_none
from cp_compile.passes.dcp_attention import DCPAttentionPass
from cp_compile.passes.pass_manager import PassManager


class CpAscendBackend:
    """A torch.compile backend: cp-compile passes, then a lowering.

    config: checked against the parallel state when given (it must match the
    config passed to `init_parallel`); without a parallel state only dcp = 1 is
    allowed (the passes then leave the graph unchanged).
    """

    def __init__(self, config: CPConfig | None = None, lowering: Lowering = "auto",
                 torchair_mode: TorchairMode = "reduce-overhead") -> None:
        self.config = config
        self.lowering = lowering
        self.torchair_mode = torchair_mode
        self.pass_managers: list[PassManager] = []  # one per compiled graph, for inspection

    def make_pass_manager(self) -> PassManager:
        state = parallel_state_or_none()
        if state is None:
            if self.config is not None and self.config.dcp > 1:
                raise ConfigError("DCP needs an initialised parallel state",
                                  f"decode_context_parallel_size={self.config.dcp} but init_parallel was not called",
                                  "call cp_compile.init_parallel(cfg) on every rank before compiling")
            return PassManager([])
        if self.config is not None and self.config != state.cfg:
            raise ConfigError("backend config == init_parallel config",
                              f"backend config {self.config} != parallel state config {state.cfg}",
                              "pass the same CPConfig to cp_compile.backend and cp_compile.init_parallel")
        return PassManager([DCPAttentionPass(DCPContext.from_state(state))])

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        pm = self.make_pass_manager()
        pm(gm)
        self.pass_managers.append(pm)
        return lower(gm, example_inputs, self.lowering, self.torchair_mode)


def backend(config: CPConfig | None = None, lowering: Lowering = "auto",
            torchair_mode: TorchairMode = "reduce-overhead") -> CpAscendBackend:
    """Build a cp_ascend backend explicitly (e.g. `lowering="aot_eager"`)."""
    return CpAscendBackend(config=config, lowering=lowering, torchair_mode=torchair_mode)


def cp_ascend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Entry-point backend: `torch.compile(model, backend="cp_ascend")`."""
    return CpAscendBackend()(gm, example_inputs)
