"""The `cp_ascend` torch.compile backend.

`torch.compile(model, backend="cp_ascend")` finds `cp_ascend` below through the
`torch_dynamo_backends` entry point, so the name works without importing
cp_compile. Per compiled graph the backend builds a `CompileContext` (the parallel
state its entry handed it: `parallel=`, the model's `AttentionSpec`, the roles
declared on `@cp_module`), validates the model against the config, runs the pass
pipeline enabled for that context on the Dynamo graph (before AOTAutograd, so every
lowering sees the rewrite) and lowers the result, wrapped so that each call first
validates the step's metadata against its caches on the host (`step_check`).
`cp_compile.backend(...)` builds
one explicitly. The compile path reads no module global: the entries (`backend()`,
the `cp_ascend` entry point, `compile_model` / `@cp_module` at their first call)
take the parallel state as an argument or, when none is given, read the current one
(`init_parallel`'s) once, there. See docs/architecture.md for the data flow.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch.fx as fx

import cp_compile.ops  # noqa: F401  (registers cp::* ops before any graph is traced)
from cp_compile.base.config import AttentionSpec, ConfigError, CPConfig
from cp_compile.passes.context import CompileContext, RoleBinding
from cp_compile.compiler.lowering import Lowering, TorchairMode, lower
from cp_compile.runtime.metadata import BatchKind
from cp_compile.runtime.parallel_state import ParallelState, parallel_state_or_none
from cp_compile.passes.pass_manager import PassManager
from cp_compile.compiler.step_check import StepCheck, checked

try:  # Dynamo re-raises these unwrapped (torch >= 2.6); see `_passes_through_dynamo`.
    from torch._dynamo.exc import ShortenTraceback as _DynamoPassThrough
except ImportError:  # pragma: no cover - older torch: the error arrives as BackendCompilerFailed
    _DynamoPassThrough = None


def _passes_through_dynamo(err: ConfigError) -> ConfigError:
    """The same ConfigError, of a subclass Dynamo does not wrap in BackendCompilerFailed.

    Dynamo wraps every exception a backend raises, so `except cp_compile.ConfigError`
    around a plain `torch.compile(model, backend=...)` call would never fire; it lets
    its own ShortenTraceback family through, which this subclass joins.
    """
    if _DynamoPassThrough is None:
        return err
    cls = type("ConfigError", (ConfigError, _DynamoPassThrough), {"__module__": ConfigError.__module__})
    new = cls.__new__(cls)
    new.__dict__.update(err.__dict__)
    new.args = err.args
    new.first_useful_frame = None  # keep the whole traceback (ShortenTraceback would trim it)
    return new


class CpAscendBackend:
    """A torch.compile backend: cp-compile passes, then a lowering.

    config: checked against the parallel state when given (it must match the config
    passed to `init_parallel`). parallel: the parallel state the compiles are
    specialised on (its `layout`, its measured collective costs), handed in by the
    entry; without one only tp = dcp = pcp = 1 is allowed (the pipeline is then
    empty). attention: the model's `AttentionSpec`, required at dcp > 1 or pcp > 1
    and validated against the config before any pass runs. roles: the resolved
    roles of `@cp_module` (`context.resolve_roles`).
    batch_kind: the batches its graphs serve (None: all; see `CompileContext.batch_kind`).
    """

    def __init__(self, config: CPConfig | None = None, lowering: Lowering = "auto",
                 torchair_mode: TorchairMode = "reduce-overhead", attention: AttentionSpec | None = None,
                 roles: tuple[RoleBinding, ...] = (), batch_kind: BatchKind | None = None,
                 parallel: ParallelState | None = None) -> None:
        self.config = config
        self.parallel = parallel
        self.batch_kind = batch_kind
        self.lowering = lowering
        self.torchair_mode = torchair_mode
        self.attention = attention
        self.roles = roles
        self.pass_managers: list[PassManager] = []  # one per compiled graph, for inspection
        self.contexts: list[CompileContext] = []  # the context each graph was compiled in
        # Validate each call's metadata against its caches on the host before the graph
        # runs (`step_check.StepCheck`). CompiledForward validates at its own entry and
        # turns this off; so can a measured hot path that builds its metadata itself.
        self.validate_steps = True

    def make_context(self) -> CompileContext:
        """The context of a compile now, on this rank; ConfigError if the model or
        the config cannot be served."""
        state = self.parallel
        if state is None:
            cfg = self.config or CPConfig()
            tp, dcp, pcp = cfg.tensor_parallel_size, cfg.decode_context_parallel_size, cfg.prefill_context_parallel_size
            if dcp > 1 or pcp > 1 or tp > 1:
                raise ConfigError("parallel compiles need an initialised parallel state",
                                  f"tensor_parallel_size={tp}, decode_context_parallel_size={dcp}, "
                                  f"prefill_context_parallel_size={pcp} but the backend has none",
                                  "call cp_compile.init_parallel(cfg) on every rank before building the backend "
                                  "(or pass parallel=init_parallel(cfg) to cp_compile.backend / compile_model / "
                                  "cp_module)")
            ctx = CompileContext(config=cfg, attention=self.attention, roles=self.roles, batch_kind=self.batch_kind)
        else:
            if self.config is not None and self.config != state.cfg:
                raise ConfigError("backend config == init_parallel config",
                                  f"backend config {self.config} != parallel state config {state.cfg}",
                                  "pass the same CPConfig to cp_compile.backend and cp_compile.init_parallel")
            ctx = CompileContext.from_state(state, attention=self.attention, roles=self.roles,
                                            batch_kind=self.batch_kind)
        cfg = ctx.config
        if ctx.attention is not None:
            cfg.validate_for(ctx.attention)
        elif cfg.decode_context_parallel_size > 1 or cfg.prefill_context_parallel_size > 1:
            raise ConfigError("the model declares its attention under DCP / PCP",
                              f"decode_context_parallel_size={cfg.decode_context_parallel_size}, "
                              f"prefill_context_parallel_size={cfg.prefill_context_parallel_size} "
                              f"and no AttentionSpec",
                              "give the model an attention_spec() method returning cp_compile.AttentionSpec "
                              "(cp_module / compile_model read it), or pass attention= to cp_compile.backend")
        return ctx

    def for_batch_kind(self, kind: BatchKind) -> "CpAscendBackend":
        """The same backend for graphs that serve only `kind` batches."""
        b = CpAscendBackend(config=self.config, lowering=self.lowering, torchair_mode=self.torchair_mode,
                            attention=self.attention, roles=self.roles, batch_kind=kind, parallel=self.parallel)
        b.validate_steps = self.validate_steps
        return b

    def make_pass_manager(self) -> PassManager:
        ctx = self.make_context()
        self.contexts.append(ctx)
        return PassManager.for_context(ctx)

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        # Read before the passes rewrite the single-device ops (they name the inputs).
        check = StepCheck(gm) if self.validate_steps else None
        try:
            pm = self.make_pass_manager()
            self.pass_managers.append(pm)
            pm(gm)
        except ConfigError as err:
            raise _passes_through_dynamo(err) from None
        compiled = lower(gm, example_inputs, self.lowering, self.torchair_mode)
        if check is None:
            return compiled
        # cp: the context this graph was compiled in. bind warns about cache writes it cannot check.
        check.bind(gm, cp=self.contexts[-1].cp.size)
        return checked(compiled, check) if check.groups else compiled


def backend(config: CPConfig | None = None, lowering: Lowering = "auto",
            torchair_mode: TorchairMode = "reduce-overhead", attention: AttentionSpec | None = None,
            roles: tuple[RoleBinding, ...] = (), parallel: ParallelState | None = None) -> CpAscendBackend:
    """Build a cp_ascend backend explicitly (e.g. `lowering="aot_eager"`). `parallel`:
    the state from `init_parallel`; None = the current one, read here (an entry)."""
    return CpAscendBackend(config=config, lowering=lowering, torchair_mode=torchair_mode, attention=attention,
                           roles=roles, parallel=parallel if parallel is not None else parallel_state_or_none())


def cp_ascend(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """Entry-point backend: `torch.compile(model, backend="cp_ascend")`. The named
    entry takes no arguments, so it reads the current parallel state, here."""
    return CpAscendBackend(parallel=parallel_state_or_none())(gm, example_inputs)
