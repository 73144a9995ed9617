"""`@cp_compile.cp_module`: opt a model module into cp-compile (DESIGN.md §1).

    @cp_compile.cp_module(o_proj="self_attn.o_proj", indexer="self_attn.indexer")
    class MyModel(nn.Module):
        def forward(self, input_ids, positions, kv_caches, meta): ...

The decorator
- records roles the passes cannot infer from the graph (which Linear is the
  o_proj, which submodule is the indexer), checked against the module at init;
- marks token-count dimensions dynamic (the named tensor arguments' dim 0 and every
  `AttentionMetadata` field), so decode steps with new batch sizes and sequence
  lengths do not recompile;
- compiles `forward` with the cp_ascend backend (`fullgraph=True`) on first call.

`module.cp_backend` is the backend instance (its `pass_managers` record what each
compiled graph's passes rewrote); `module.cp_eager_forward(...)` runs uncompiled.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import fields, is_dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch
from torch import nn

from cp_compile.backend import CpAscendBackend
from cp_compile.config import CPConfig
from cp_compile.lowering import Lowering, TorchairMode
from cp_compile.metadata import AttentionMetadata

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


def cp_module(cls: M | None = None, *, o_proj: str | None = None, indexer: str | None = None,
              dynamic_args: Sequence[str] = ("input_ids", "positions", "meta"), config: CPConfig | None = None,
              lowering: Lowering = "auto", torchair_mode: TorchairMode = "reduce-overhead",
              compile: bool = True) -> Callable[[M], M] | M:
    """Class decorator; see the module docstring. `compile=False` only records roles."""

    def wrap(klass: M) -> M:
        orig_init = klass.__init__
        orig_forward = klass.forward
        params = list(inspect.signature(orig_forward).parameters)[1:]
        unknown = [a for a in dynamic_args if a not in params]
        if unknown:
            raise TypeError(f"cp_module({klass.__name__}): dynamic_args {unknown} are not arguments of forward "
                            f"{params}. Fix: name forward's token-count arguments")

        @functools.wraps(orig_init)
        def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
            orig_init(self, *args, **kwargs)
            roles = {"o_proj": o_proj, "indexer": indexer}
            for role, path in roles.items():
                if path is None:
                    continue
                for name, mod in self.named_modules():
                    if name == path or name.endswith("." + path):
                        break
                else:
                    raise ValueError(f"cp_module({klass.__name__}): role {role}={path!r} names no submodule. "
                                     f"Fix: give the attribute path of the {role} module, e.g. 'self_attn.o_proj'")
            self.cp_roles = {k: v for k, v in roles.items() if v is not None}
            self.cp_backend = CpAscendBackend(config=config, lowering=lowering, torchair_mode=torchair_mode)
            self._cp_compiled = None

        @functools.wraps(orig_forward)
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not compile:
                return orig_forward(self, *args, **kwargs)
            bound = inspect.signature(orig_forward).bind(self, *args, **kwargs)
            for name in dynamic_args:
                if name in bound.arguments:
                    _mark_dynamic(bound.arguments[name])
            if self._cp_compiled is None:
                self._cp_compiled = torch.compile(functools.partial(orig_forward, self), backend=self.cp_backend,
                                                  fullgraph=True)
            # Token count and request count often coincide (decode): no duck-sizing
            # equality between them, or the next mixed batch would recompile.
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                return self._cp_compiled(*args, **kwargs)

        def cp_eager_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return orig_forward(self, *args, **kwargs)

        klass.__init__ = __init__
        klass.forward = forward
        klass.cp_eager_forward = cp_eager_forward
        return klass

    return wrap(cls) if cls is not None else wrap
