"""Launch helpers shared by the Triton kernels (docs/architecture.md §8).

Kept free of kernel code so every kernel file stays one kernel plus its launcher.
Also holds what the Triton-Ascend lowering check (`tools/ascend_check.py`) needs from a
kernel module: the launch capture and the `LoweringDeclaration` each module keeps
next to its kernels.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import triton

# Persistent-grid size where there is no hardware to size for: CPU tensors (the
# interpreter) and the lowering capture. Device grids come from `max_programs`.
CPU_MAX_PROGRAMS = 32

# The kernels index in int32 (docs/architecture.md §8, and Triton-Ascend's vector units are
# slower on int64); launchers refuse tensors whose element offsets do not fit.
INT32_MAX = 2**31 - 1

# Interpreted twins of jitted kernels, keyed by the kernel object.
_INTERPRETED: dict[int, Any] = {}


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (tl.arange needs power-of-two extents)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= max(n, 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


# ----------------------------------------------------------------------------- grid


@functools.lru_cache(maxsize=None)
def _device_cores(device_type: str, index: int, uses_cube: bool) -> int:
    if device_type == "npu":
        # triton-ascend's driver; a kernel with tl.dot runs on AI cores (each a cube
        # plus its vector cores), a vector-only kernel on the vector cores.
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        return int(props["num_aicore"] if uses_cube else props["num_vectorcore"])
    if device_type == "cuda":
        return int(torch.cuda.get_device_properties(index).multi_processor_count)
    raise ValueError(f"no core count for device type {device_type!r}")


def max_programs(device: torch.device, *, uses_cube: bool = False) -> int:
    """Programs a persistent 1D grid may launch on `device`: one per physical core.

    NPU: `num_vectorcore` (vector-only kernels) or `num_aicore` (kernels using
    tl.dot) from triton-ascend's driver; CUDA: the SM count; CPU (interpreter):
    CPU_MAX_PROGRAMS.
    """
    if device.type == "cpu":
        return CPU_MAX_PROGRAMS
    index = device.index
    if index is None:
        index = torch.npu.current_device() if device.type == "npu" else torch.cuda.current_device()
    return _device_cores(device.type, int(index), uses_cube)


def grid_size(work_items: int, device: torch.device, num_programs: int | None = None, *,
              uses_cube: bool = False) -> int:
    """Persistent grid: never more programs than work items or than the device's cores.

    num_programs overrides the core count (tests use it to force several work
    items per program).
    """
    cap = max_programs(device, uses_cube=uses_cube) if num_programs is None else int(num_programs)
    if cap < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    return max(1, min(int(work_items), cap))


def require_int32_offsets(**tensors: torch.Tensor) -> None:
    """Raise unless every element offset of each tensor (from its data pointer) fits int32."""
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
        if span > INT32_MAX:
            raise ValueError(
                f"{name} {tuple(t.shape)} strides {t.stride()} spans {span} elements; the Triton kernels index "
                f"in int32 (max {INT32_MAX}, docs/architecture.md §8). Pass a smaller view: one tensor per layer, or fewer "
                "blocks per cache tensor.")


# ----------------------------------------------------------------------------- launch


def interpreter_active() -> bool:
    """True when triton.language itself was decorated in interpreter mode.

    The interpreter needs the whole call tree interpreted: tl.sum, tl.max, tl.zeros
    ... are themselves @triton.jit functions, decorated when triton is first imported.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


@dataclass(frozen=True)
class Launch:
    """One kernel launch as a launcher issued it (recorded by `capture_launches`)."""

    kernel: Any  # the @triton.jit function (not an interpreted twin)
    grid: tuple[int, ...]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def arg(self, name: str) -> Any:
        """An argument by the kernel's parameter name: readers of a launch do not depend on
        its argument positions, which move when a kernel gains a parameter."""
        if name in self.kwargs:
            return self.kwargs[name]
        names = list(self.kernel.arg_names)
        if name not in names or names.index(name) >= len(self.args):
            raise KeyError(f"{getattr(self.kernel, '__name__', self.kernel)} has no positional argument {name!r}: "
                           f"{names[:len(self.args)]}")
        return self.args[names.index(name)]


_CAPTURE: list[Launch] | None = None


@contextlib.contextmanager
def capture_launches() -> Iterator[list[Launch]]:
    """Within the block, launchers record their kernel launches instead of running them.

    The lowering check runs the launchers on small CPU tensors this way, so the
    argument types and constexprs it compiles are exactly what the launcher passes.
    """
    global _CAPTURE
    previous, _CAPTURE = _CAPTURE, []
    try:
        yield _CAPTURE
    finally:
        _CAPTURE = previous


# (device type, cores) a launcher plans for instead of its tensors' device: set only by
# `planning_for`, inside `capture_launches` (tools/device_check.py --plan).
_TARGET: tuple[str, int] | None = None


@contextlib.contextmanager
def planning_for(device_type: str, cores: int) -> Iterator[None]:
    """Within the block (and inside `capture_launches`), launchers that ask `target_of`
    size their launches for `device_type` with `cores` cores rather than for their CPU
    tensors: the plan of a device's launches, captured from the real launchers on a
    machine without that device."""
    global _TARGET
    if _CAPTURE is None:
        raise RuntimeError("planning_for() only inside capture_launches(): planned launches must not run")
    previous, _TARGET = _TARGET, (device_type, int(cores))
    try:
        yield
    finally:
        _TARGET = previous


def target_of(device: torch.device, *, uses_cube: bool = False) -> tuple[str, int]:
    """(device type, core count) a launch on `device` is sized for: the device's own, or
    the one `planning_for` set."""
    if _TARGET is not None:
        return _TARGET
    return device.type, max_programs(device, uses_cube=uses_cube)


class _Recorder:
    def __init__(self, kernel: Any, sink: list[Launch]) -> None:
        self.kernel, self.sink = kernel, sink

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def record(*args: Any, **kwargs: Any) -> None:
            self.sink.append(Launch(self.kernel, tuple(grid), args, kwargs))

        return record


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """The launchable form of `kernel` for tensors on `device`.

    `TRITON_INTERPRET` is read when `@triton.jit` runs, i.e. at import. Accelerator
    tensors get the kernel as decorated. CPU tensors can only run under the
    interpreter: if triton.language was imported in interpreter mode but this kernel
    module was not (the variable was set in between), build an interpreted twin of
    the same Python function, its jitted helpers twinned too (`_interpreted_twin`); if triton itself was imported without the variable,
    fail with a clear message instead of a pointer error deep in the launcher.
    Inside `capture_launches()` the launch is recorded, not run.
    """
    if _CAPTURE is not None:
        return _Recorder(kernel, _CAPTURE)
    if device.type != "cpu":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if not interpreter_active():
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (it is read at @triton.jit decoration time).")
    return _interpreted_twin(kernel)


def _interpreted_twin(jitted: Any) -> Any:
    """The InterpretedFunction of a @triton.jit function decorated outside interpreter
    mode, its jitted callees twinned too.

    The interpreter runs a function's Python body in its module's globals; a callee
    there is the module's JITFunction, whose call raises outside a compiled kernel. So
    the twin runs the same code object in a copy of those globals in which every
    JITFunction (the kernel's device-function helpers, e.g. core/attention_tile.py's) is
    replaced by its own twin, recursively. The module's globals are not touched."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    twin = _INTERPRETED.get(id(jitted))
    if twin is not None:
        return twin
    fn = jitted.fn
    scope = dict(fn.__globals__)
    body = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    twin = InterpretedFunction(body)
    _INTERPRETED[id(jitted)] = twin  # before the callees: a cycle finds this twin
    for name, value in fn.__globals__.items():
        if isinstance(value, JITFunction) and name in fn.__code__.co_names:
            scope[name] = _interpreted_twin(value)
    return twin


# ----------------------------------------------------------------------------- lowering declaration


@dataclass(frozen=True)
class LoweringDeclaration:
    """What the Triton-Ascend lowering check needs from one kernel module (`LOWERING`).

    examples: () -> [(label, thunk)]; each thunk calls the module's launcher the way
        the project does (same dtypes, head dims, batch kinds), on small CPU tensors.
        The check records the launches and lowers every distinct (signature,
        constexprs) specialisation; a @triton.jit kernel of the module that no
        example launches fails the check.
    int64: kernel name -> why it needs int64 values (docs/architecture.md §8 wants int32).
    helpers: @triton.jit device functions of the module, called from kernels only.
    not_on_ascend: kernel name -> why the NPU does not run it (its ops declare `npu=Absent`):
        still launched by an example, so the CUDA AOT check compiles it; the Triton-Ascend
        check lists it as absent with the reason instead of lowering it.
    """

    examples: Callable[[], Iterable[tuple[str, Callable[[], Any]]]]
    int64: dict[str, str] = field(default_factory=dict)
    helpers: tuple[str, ...] = ()
    not_on_ascend: dict[str, str] = field(default_factory=dict)


__all__ = ["CPU_MAX_PROGRAMS", "INT32_MAX", "Launch", "LoweringDeclaration", "capture_launches", "grid_size",
           "interpreter_active", "kernel_for", "max_programs", "next_pow2", "planning_for", "prev_pow2",
           "require_int32_offsets", "target_of"]
