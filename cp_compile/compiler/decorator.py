"""`@cp_compile.cp_module`: opt a model module into cp-compile (docs/architecture.md §1).

    @cp_compile.cp_module(o_proj="self_attn.o_proj", indexer="self_attn.indexer")
    class MyModel(nn.Module):
        def forward(self, input_ids, positions, kv_caches, meta): ...

The decorator
- records roles the passes cannot infer from the graph (which Linear is the
  o_proj, which submodule is the indexer), resolved against the module at init
  (`module.cp_roles`, a tuple of `RoleBinding`) and handed to every pass in the
  `CompileContext`;
- reads the model's `AttentionSpec` (`model.attention_spec()`, or `attention=`) and
  validates it against the config before the first trace;
- marks token-count dimensions dynamic (the named tensor arguments' dim 0 and every
  `AttentionMetadata` field), so decode steps with new batch sizes and sequence
  lengths do not recompile;
- compiles `forward` with the cp_ascend backend (`fullgraph=True`) on first call.

`module.cp_compiled.backend.pass_managers` record what each compiled graph's passes
rewrote; `module.cp_eager_forward(...)` runs uncompiled. `compile_model(module)`
does the same for a module built elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from cp_compile.compiler.backend import CpAscendBackend
from cp_compile.base.config import PREFILL_KINDS, AttentionSpec, ConfigError, CPConfig
from cp_compile.passes.context import RoleBinding, resolve_roles
from cp_compile.compiler.lowering import Lowering, TorchairMode
from cp_compile.runtime.metadata import AttentionMetadata, BatchKind, batch_kind, is_fresh
from cp_compile.runtime.metadata_checks import validate_forward_args
from cp_compile.ops.pcp.ops import pcp_token_index
from cp_compile.ops.core.pcp_layout import pcp_token_table
from cp_compile.runtime.parallel_state import ParallelState, parallel_state_or_none

M = TypeVar("M", bound=type[nn.Module])


def _mark_dynamic(value: Any) -> None:
    if isinstance(value, torch.Tensor):
        # maybe_: a size-1 batch at warm-up specialises instead of raising.
        torch._dynamo.maybe_mark_dynamic(value, 0)
    elif isinstance(value, AttentionMetadata) or (is_dataclass(value) and not isinstance(value, type)):
        for f in fields(value):
            t = getattr(value, f.name)
            if isinstance(t, torch.Tensor):
                for d in range(t.dim()):  # tokens, requests and block-table width all vary
                    torch._dynamo.maybe_mark_dynamic(t, d)


def no_size_specialisation() -> Any:
    """The one mechanism that keeps a compiled step graph valid for every batch size
    (issue 19; the HF Engine runs through it too):
    - no duck sizing: token count and request count often coincide (decode), and an
      equality guard between them would recompile the next mixed batch;
    - backed size-oblivious symbols: a dim marked dynamic that is 1 (one request, a
      one-token decode, a one-block table) is not specialised to 1, so a 1-request
      step after 2-request steps (or the other way round) reuses the graph.
    """
    return torch.fx.experimental._config.patch(use_duck_shape=False, backed_size_oblivious=True)


def only_marked_dims_dynamic() -> Any:
    """Dynamic dims are the ones `CompiledForward` marks, nothing else: Dynamo's automatic
    dynamic shapes off while a step compiles. Its state is kept per code object, so two
    models sharing one forward (a target and its draft model, `examples/models/common.py`)
    look to it like one function whose sizes and floats changed: after the draft compiled,
    the target's verify compile made the caches' head dim dynamic (a symbolic value width
    then reached the A2A merge) and traced the attention scale as a symbolic float, which
    the `cp::*` ops take as a Python float, so Dynamo restarted the analysis and the backend
    ran twice for one compile (issue 25). With it off, each model gets its own static cache
    entry: one compile per model and batch kind. A size that really varies is marked
    (`_mark_dynamic`)."""
    return torch._dynamo.config.patch(automatic_dynamic_shapes=False)


def _take_tokens(x: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
    """Rows `token_index` of x ([T, ...] -> [T_loc, ...]); zeros where the index is -1
    (a rank's padding rows: token id 0 at position 0, harmless, never read back)."""
    rows = x[token_index.clamp(min=0)]  # [T_loc, ...]
    keep = (token_index >= 0).view(-1, *([1] * (x.dim() - 1)))
    return torch.where(keep, rows, torch.zeros((), dtype=x.dtype, device=x.device))




def _pad_single_token(arguments: dict[str, Any], dynamic_args: Sequence[str]) -> dict[str, Any]:
    """A 1-token step as a 2-token one: a padding request of one token (slot -1, so no
    cache write; position 0; block row of zeros) after the real one.

    Why: Inductor orders the strides of a collective's or a custom op's input by
    comparing them, and with a token dim T in a non-innermost position ([H, T, D]
    gathers under DCP) that comparison guards T > 1 even on backed size-oblivious
    symbols; model code traced by Dynamo (einsum in the HF SFA attention) guards
    T != 1 the same way. So a 1-token decode after larger steps would recompile
    (issue 19). The
    padding token's outputs are dropped by the caller (`_first_token_rows`); it
    attends only position 0 of block 0 (finite, never written, never read back)."""
    out = dict(arguments)
    for name in dynamic_args:
        v = arguments.get(name)
        if isinstance(v, AttentionMetadata):
            out[name] = AttentionMetadata(
                query_start_loc=torch.cat([v.query_start_loc, v.query_start_loc[-1:] + 1]),
                seq_lens=torch.cat([v.seq_lens, torch.ones_like(v.seq_lens[:1])]),
                block_table=torch.cat([v.block_table, torch.zeros_like(v.block_table[:1])]),
                slot_mapping=torch.cat([v.slot_mapping, torch.full_like(v.slot_mapping[:1], -1)]),
                positions=torch.cat([v.positions, torch.zeros_like(v.positions[:1])]))
        elif isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == 1:
            out[name] = torch.cat([v, torch.zeros_like(v[:1])])
    return out


def _first_token_rows(result: Any) -> Any:
    """Outputs of a padded 1-token step ([2, ...] per-token tensors) -> the real token's [1, ...]."""
    if isinstance(result, torch.Tensor):
        return result[:1] if result.dim() >= 1 and result.shape[0] == 2 else result
    if isinstance(result, (tuple, list)):
        return type(result)(_first_token_rows(r) for r in result)
    return result


def _num_tokens(arguments: dict[str, Any]) -> int | None:
    meta = next((v for v in arguments.values() if isinstance(v, AttentionMetadata)), None)
    return None if meta is None else meta.num_tokens


def validation_cp(backend: Any, cp: int) -> int:
    """The shard count a forward compiled with `backend` is validated at: `cp` (the
    compile context's cache group size, pcp * dcp) under cp_ascend; 1 under any other
    backend, which runs the single-device ops as written over unsharded caches."""
    return cp if isinstance(backend, CpAscendBackend) else 1

class CompiledForward:
    """A module's forward compiled with the cp_ascend backend, with dynamic token dims.

    Under `CPConfig.graph_per_batch_kind` (PCP, DSA-CP) it keeps one compiled graph
    per batch kind, each from its own backend (`backends["decode"]`,
    `backends["prefill"]`), and picks one per step from the metadata on the host
    (`metadata.batch_kind`). Dynamo guards each cache entry on its backend, so the
    two graphs never evict or recompile each other. Otherwise `backends` is
    `{None: backend}` and one graph serves every batch. With speculation
    (`num_speculative_tokens` = k > 0) verification steps (at most k + 1 new tokens
    per request) get a graph of their own, `backends["verify"]`, compiled like a
    decode graph: the whole batch on every rank, never token-sharded.

    PCP (pcp > 1) prefill steps are token-sharded (docs/pcp.md §4): on the host, once
    per step, `pcp_token_table` gives this rank's token indices ([T_loc], -1 padded);
    the prefill graph is compiled from a wrapper that takes them as its first argument,
    marks them with `cp::pcp_token_index` and slices, inside the graph, every dynamic argument whose
    dim 0 is the step's token count (input_ids, positions) to those rows before calling
    forward. The metadata stays global. The `pcp_attention` pass rewrites the attention
    for this rank's tokens and all-gathers the per-token outputs back to global order,
    so the caller sees the single-device result ([T, ...]). Decode steps run the whole
    batch on every rank. A prefill step in which no request has cached context
    (`metadata.is_fresh`) runs a third graph, `backends["fresh_prefill"]` (compiled at
    the first such step), whose attention skips the empty context part; a step where
    any request has context, mixed batches included, runs `backends["prefill"]`.
    """

    def __init__(self, module: nn.Module, forward: Callable[..., Any], dynamic_args: Sequence[str],
                 backend: CpAscendBackend, num_speculative_tokens: int = 0) -> None:
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 0:
            raise ConfigError("num_speculative_tokens >= 0", f"num_speculative_tokens={num_speculative_tokens!r}",
                              "pass the number of draft tokens per request and step (0: no speculation)")
        self.num_speculative_tokens = num_speculative_tokens
        self.signature = inspect.signature(forward)
        unknown = [a for a in dynamic_args if a not in self.signature.parameters]
        if unknown:
            raise TypeError(f"{type(module).__name__}: dynamic_args {unknown} are not arguments of forward "
                            f"{list(self.signature.parameters)}. Fix: name forward's token-count arguments")
        self.dynamic_args = tuple(dynamic_args)
        self.forward = forward
        self.backend = backend
        self.backends: dict[BatchKind | None, CpAscendBackend] = {}
        self._compiled: dict[BatchKind | None, Callable[..., Any]] = {}
        self._ran: set[BatchKind | None] = set()  # the kinds whose graph has run (compiled)
        self._validated = False
        self._pcp_size, self._pcp_rank = 1, 0
        self._cp_size = 1  # the cache's context-parallel group (pcp * dcp), from the compile context
        # Check each step's metadata against the caches before the graph runs (outside
        # it; `validate_forward_args`). Set False only for a measured hot path.
        self.validate_inputs = True
        # PCP: fresh prefill steps run their own graph (no context part). False runs
        # them through the general prefill graph (an A/B comparison of the two).
        self.fresh_prefill_graph = True

    def _setup(self) -> None:
        # The entry binds the parallel state (the one given to compile_model / cp_module,
        # else init_parallel's current one, read here, once) before the first trace; the
        # compiles read it from the backend, never from the module global.
        if self.backend.parallel is None:
            self.backend.parallel = parallel_state_or_none()
        # Before the first trace: a model the config cannot serve fails here, as a
        # ConfigError, not half-way through tracing.
        ctx = self.backend.make_context()
        kinds: tuple[BatchKind | None, ...] = ("decode", "prefill") if ctx.config.graph_per_batch_kind else (None,)
        if self.num_speculative_tokens > 0:
            kinds += ("verify",)
        if ctx.pcp.size > 1:
            kinds += ("fresh_prefill",)  # torch.compile is lazy: compiled at the first fresh step
        self._pcp_size, self._pcp_rank = ctx.pcp.size, ctx.pcp.rank
        self._cp_size = ctx.cp.size
        if isinstance(self.backend, CpAscendBackend):
            # This entry validates each step itself (validate_forward_args, with the
            # unflattened arguments): the backend's per-call check would repeat it.
            self.backend.validate_steps = False
        for kind in kinds:
            b = self.backend if kind is None else self.backend.for_batch_kind(kind)
            self.backends[kind] = b
            fn = self._token_sharded if kind in PREFILL_KINDS and self._pcp_size > 1 else self.forward
            self._compiled[kind] = torch.compile(fn, backend=b, fullgraph=True)
        # Every lowering: see _pad_single_token (Inductor's stride order; model code such
        # as einsum guards T != 1 while Dynamo traces, whatever the lowering).
        self._pads_single_token = True
        self._validated = True

    def _token_sharded(self, token_index: torch.Tensor, token_slots: tuple[int | str, ...], *args: Any,
                       **kwargs: Any) -> Any:
        """The PCP prefill graph's entry (traced): this rank's rows of the token-dim
        arguments (positional indices or keyword names in `token_slots`), then forward.
        `passes.pcp_attention` finds the token indices as the argument of the one
        `cp::pcp_token_index` call (and removes it), not by any name."""
        token_index = pcp_token_index(token_index)
        args_l = list(args)
        for slot in token_slots:
            if isinstance(slot, int):
                args_l[slot] = _take_tokens(args_l[slot], token_index)
            else:
                kwargs[slot] = _take_tokens(kwargs[slot], token_index)
        return self.forward(*args_l, **kwargs)

    def _pcp_call(self, compiled: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        """Run a PCP prefill step: this rank's token indices (host, once per step),
        then the token-sharded graph on the global arguments."""
        meta = next(v for v in bound.arguments.values() if isinstance(v, AttentionMetadata))
        T = meta.num_tokens
        table = pcp_token_table(meta.query_start_loc, T, pcp=self._pcp_size)  # [pcp, T_loc], host sync
        token_index = table[self._pcp_rank].contiguous()  # [T_loc]
        names = [n for n in self.dynamic_args if isinstance(bound.arguments.get(n), torch.Tensor)
                 and bound.arguments[n].dim() >= 1 and bound.arguments[n].shape[0] == T]
        args, kwargs = bound.args, dict(bound.kwargs)
        params = list(self.signature.parameters)
        slots = tuple(params.index(n) if n not in kwargs else n for n in names)
        _mark_dynamic(token_index)
        return compiled(token_index, slots, *args, **kwargs)

    def batch_kind_of(self, arguments: dict[str, Any]) -> BatchKind | None:
        """The graph a step runs in: None when one graph serves every batch but verify."""
        if list(self._compiled) == [None]:
            return None
        meta = next((v for v in arguments.values() if isinstance(v, AttentionMetadata)), None)
        if meta is None:
            raise TypeError("this config compiles one graph per batch kind (PCP or DSA-CP) and picks it from the "
                            "step's AttentionMetadata, but forward got none. Fix: pass the AttentionMetadata as an "
                            "argument of forward")
        kind = batch_kind(meta, self.num_speculative_tokens)
        if kind == "prefill" and "fresh_prefill" in self._compiled and self.fresh_prefill_graph and is_fresh(meta):
            return "fresh_prefill"
        return kind if kind in self._compiled else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._validated:
            self._setup()
        bound = self.signature.bind(*args, **kwargs)
        if self.validate_inputs:
            # Global metadata: every rank refuses the same step, before any collective.
            validate_forward_args(bound.arguments, cp=validation_cp(self.backend, self._cp_size))
        kind = self.batch_kind_of(bound.arguments)
        compiled = self._compiled[kind]
        pad = self._pads_single_token and _num_tokens(bound.arguments) == 1
        if pad:
            bound.arguments.update(_pad_single_token(bound.arguments, self.dynamic_args))
            args, kwargs = bound.args, bound.kwargs
        for name in self.dynamic_args:
            if name in bound.arguments:
                _mark_dynamic(bound.arguments[name])
        # A kind's first step compiles its graph under "fail_on_recompile" too: a first
        # compile is no recompile, and which kinds a warm-up meets depends on the batches
        # (PCP: a fresh prompt first, a chunk on a prefix later). "fail_on_recompile"
        # still guards every graph after its first step; other stances (force_eager,
        # eager_on_recompile) are the caller's and stay as they are.
        first = (torch.compiler.set_stance("default") if kind not in self._ran and _stance() == "fail_on_recompile"
                 else contextlib.nullcontext())
        with no_size_specialisation(), only_marked_dims_dynamic(), first:
            try:
                if kind in PREFILL_KINDS and self._pcp_size > 1:
                    result = self._pcp_call(compiled, bound)
                else:
                    result = compiled(*args, **kwargs)
                    result = _first_token_rows(result) if pad else result
            except torch._dynamo.exc.BackendCompilerFailed as e:
                if isinstance(e.inner_exception, ConfigError):  # torch versions that wrap it
                    raise e.inner_exception from None
                raise
        self._ran.add(kind)
        return result


def _stance() -> str | None:
    """The current `torch.compiler.set_stance` stance (torch keeps it in `eval_frame._stance`;
    None where a torch version does not)."""
    return getattr(getattr(torch._dynamo.eval_frame, "_stance", None), "stance", None)


def _attention_of(module: nn.Module, attention: AttentionSpec | None) -> AttentionSpec | None:
    if attention is not None:
        return attention
    spec = getattr(module, "attention_spec", None)
    return spec() if callable(spec) else None


def _compiled_forward(module: nn.Module, forward: Callable[..., Any], dynamic_args: Sequence[str],
                      config: CPConfig | None, lowering: Lowering, torchair_mode: TorchairMode,
                      attention: AttentionSpec | None, roles: tuple[RoleBinding, ...],
                      num_speculative_tokens: int = 0, parallel: ParallelState | None = None) -> CompiledForward:
    backend = CpAscendBackend(config=config, lowering=lowering, torchair_mode=torchair_mode,
                              attention=_attention_of(module, attention), roles=roles, parallel=parallel)
    return CompiledForward(module, forward, dynamic_args, backend, num_speculative_tokens)


def compile_model(module: nn.Module, *, dynamic_args: Sequence[str] = ("input_ids", "positions", "meta"),
                  config: CPConfig | None = None, lowering: Lowering = "auto",
                  torchair_mode: TorchairMode = "reduce-overhead", attention: AttentionSpec | None = None,
                  o_proj: str | None = None, indexer: str | None = None,
                  num_speculative_tokens: int = 0, parallel: ParallelState | None = None) -> CompiledForward:
    """Compile `module.forward` with cp_ascend (fullgraph) and dynamic token dims.

    For modules you cannot decorate (built elsewhere); `cp_module` uses the same path
    and takes the same role and attention arguments. The returned callable's
    `.backend.pass_managers` record what the passes rewrote. `num_speculative_tokens`
    = k > 0 adds the verify graph (steps of at most k + 1 new tokens per request).
    `parallel`: the state from `init_parallel` the graphs are compiled for; None = the
    current one at the first call.
    """
    roles = resolve_roles(module, {"o_proj": o_proj, "indexer": indexer})
    return _compiled_forward(module, module.forward, dynamic_args, config, lowering, torchair_mode, attention, roles,
                             num_speculative_tokens, parallel)


def cp_module(cls: M | None = None, *, o_proj: str | None = None, indexer: str | None = None,
              dynamic_args: Sequence[str] = ("input_ids", "positions", "meta"), config: CPConfig | None = None,
              lowering: Lowering = "auto", torchair_mode: TorchairMode = "reduce-overhead",
              attention: AttentionSpec | None = None, compile: bool = True,
              num_speculative_tokens: int = 0, parallel: ParallelState | None = None) -> Callable[[M], M] | M:
    """Class decorator; see the module docstring. `compile=False` only records roles;
    `parallel` as in `compile_model`."""

    def wrap(klass: M) -> M:
        orig_init = klass.__init__
        orig_forward = klass.forward

        @functools.wraps(orig_init)
        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            orig_init(self, *args, **kwargs)
            self.cp_roles = resolve_roles(self, {"o_proj": o_proj, "indexer": indexer})
            self.cp_compiled = None
            if compile:
                self.cp_compiled = _compiled_forward(self, functools.partial(orig_forward, self), dynamic_args,
                                                     config, lowering, torchair_mode, attention, self.cp_roles,
                                                     num_speculative_tokens, parallel)

        @functools.wraps(orig_forward)
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if self.cp_compiled is None:
                return orig_forward(self, *args, **kwargs)
            return self.cp_compiled(*args, **kwargs)

        def cp_eager_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return orig_forward(self, *args, **kwargs)

        klass.__init__ = __init__
        klass.forward = forward
        klass.cp_eager_forward = cp_eager_forward
        return klass

    return wrap(cls) if cls is not None else wrap
