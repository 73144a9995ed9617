"""Launch helpers shared by the Triton kernels (DESIGN.md §8).

Kept free of kernel code so every kernel file stays one kernel plus its launcher.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

# Upper bound of the persistent 1D grid. Ascend 910B has 20 cube / 40 vector cores
# and Triton-Ascend wants grid <= physical cores; on CUDA a persistent grid this size
# is already enough for decode-sized work. Callers may pass their own `num_programs`.
DEFAULT_MAX_PROGRAMS = 32

# Interpreted twins of jitted kernels, keyed by the kernel object.
_INTERPRETED: dict[int, Any] = {}


def next_pow2(n: int) -> int:
    """Smallest power of two >= max(n, 1) (tl.arange needs power-of-two extents)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def prev_pow2(n: int) -> int:
    """Largest power of two <= max(n, 1)."""
    return 1 << (max(int(n), 1).bit_length() - 1)


def grid_size(work_items: int, num_programs: int | None) -> int:
    """Persistent grid: never more programs than work items or than the core budget."""
    cap = DEFAULT_MAX_PROGRAMS if num_programs is None else int(num_programs)
    if cap < 1:
        raise ValueError(f"num_programs must be >= 1, got {num_programs}")
    return max(1, min(int(work_items), cap))


def interpreter_active() -> bool:
    """True when triton.language itself was decorated in interpreter mode.

    The interpreter needs the whole call tree interpreted: tl.sum, tl.max, tl.zeros
    ... are themselves @triton.jit functions, decorated when triton is first imported.
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.standard.sum, InterpretedFunction)


def kernel_for(kernel: Any, device: torch.device) -> Any:
    """The launchable form of `kernel` for tensors on `device`.

    `TRITON_INTERPRET` is read when `@triton.jit` runs, i.e. at import. Accelerator
    tensors get the kernel as decorated. CPU tensors can only run under the
    interpreter: if triton.language was imported in interpreter mode but this kernel
    module was not (the variable was set in between), build an interpreted twin of
    the same Python function; if triton itself was imported without the variable,
    fail with a clear message instead of a pointer error deep in the launcher.
    """
    if device.type != "cpu":
        return kernel
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(kernel, InterpretedFunction):
        return kernel
    if not interpreter_active():
        raise RuntimeError(
            "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (it is read at @triton.jit decoration time).")
    twin = _INTERPRETED.get(id(kernel))
    if twin is None:
        twin = InterpretedFunction(kernel.fn)
        _INTERPRETED[id(kernel)] = twin
    return twin


__all__ = ["DEFAULT_MAX_PROGRAMS", "next_pow2", "prev_pow2", "grid_size", "interpreter_active", "kernel_for"]
