"""Lazy access to the Triton kernels of the op families (docs/architecture.md §8).

Importable without triton: `triton_available()` says whether the launchers can be
used. Each family's `launch.py` names its accelerator kernels with `lazy(module, name)`:
the kernel module (`<family>/triton_*.py`, which imports triton) is imported on the
first call, never at op registration, because importing triton fixes the
TRITON_INTERPRET mode (read at @triton.jit decoration) and the tests set it first.
Touching a launcher without triton raises ImportError. CPU tensors run only under
TRITON_INTERPRET=1 (set before triton is first imported), which is how the tests
check the kernels.

Each kernel module declares `LOWERING` (`core/triton_common.LoweringDeclaration`):
the launches the Triton-Ascend lowering check compiles (`python -m
tools.ascend_check`, in .venv-ascend), which finds every `triton_*.py` of the
family folders (`kernel_module_names()`).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import pkgutil
from pathlib import Path
from typing import Any, Callable

# The op packages below cp_compile.ops (core/ and parallel/ hold no kernels of their own
# except core's shared cache write, found by its triton_ prefix like the rest).
_OPS_DIR = Path(__file__).resolve().parents[1]
_OPS_PACKAGE = __name__.rsplit(".", 2)[0]  # cp_compile.ops


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when a `triton` package (upstream or triton-ascend) is installed.

    Checked with find_spec, not an import: importing triton fixes the interpreter
    mode (TRITON_INTERPRET is read at @triton.jit decoration), so a mere probe from
    op registration must not do it before a test sets the variable.
    """
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def lazy(module: str, name: str) -> Callable[..., Any]:
    """The function `name` of the kernel module `module` (dotted), fetched (and triton
    imported) on first call, not at registration. Its `__module__` / `__name__` are
    where the function lives (the op table of docs/architecture.md §4 prints them)."""
    fetched: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not fetched:
            if not triton_available():
                raise ImportError(f"{name} needs triton (pip install triton, or triton-ascend on NPU)")
            fetched.append(getattr(importlib.import_module(module), name))
        return fetched[0](*args, **kwargs)

    call.__name__ = name
    call.__qualname__ = name
    call.__module__ = module
    return call


def kernel_module_names() -> list[str]:
    """Dotted names of every Triton kernel module: `triton_*.py` in an op family folder
    (and core/'s shared ones), sorted. Found by name, so a new kernel file is checked
    (ascend_check, aot_cuda_check) without being listed anywhere."""
    names = []
    for package in sorted(p for p in _OPS_DIR.iterdir() if (p / "__init__.py").exists()):
        for info in pkgutil.iter_modules([str(package)]):
            if info.name.startswith("triton_") and info.name != "triton_common":
                names.append(f"{_OPS_PACKAGE}.{package.name}.{info.name}")
    return sorted(names)
