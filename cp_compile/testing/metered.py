"""Count a compiled model's collectives at dispatch (`CollectiveMeter`) without leaving the graph.

Dynamo runs a frame eagerly when a TorchDispatchMode is active at the call, so a meter
around `compiled(...)` would count the uncompiled model. `metered(compiled)` re-classes
the model's cp_ascend backend (before its first call) so that each compiled graph runs
under the slot's meter while one is set: the graph's own `_c10d_functional` calls are
counted as they dispatch (aot_eager / eager lowerings; Inductor calls its collectives
from generated code, which a dispatch mode may not see).
"""

from __future__ import annotations

from typing import Any, Callable

from cp_compile.base.comm_stats import CollectiveMeter


class MeterSlot:
    """`slot.meter = CollectiveMeter()` counts the next graph calls; None counts nothing."""

    meter: CollectiveMeter | None = None


def metered(compiled: Any) -> MeterSlot:
    """Wrap `compiled` (a `CompiledForward` not yet called) so its graphs run under `slot.meter`."""
    if getattr(compiled, "_compiled", None):
        raise RuntimeError("metered(compiled) must be called before the compiled model's first call")
    slot = MeterSlot()
    ref = compiled.backend

    class Metered(type(ref)):  # type: ignore[misc]
        def __call__(self, gm: Any, example_inputs: Any) -> Callable[..., Any]:
            fn = super().__call__(gm, example_inputs)

            def run(*args: Any) -> Any:
                if slot.meter is None:
                    return fn(*args)
                with slot.meter:
                    return fn(*args)

            return run

    wrapped = Metered.__new__(Metered)
    wrapped.__dict__.update(ref.__dict__)
    compiled.backend = wrapped
    return slot
