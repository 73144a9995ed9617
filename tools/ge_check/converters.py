"""Which converter code the check runs, and that every importer sees that code.

The check can run the library's GE converters, a folder of copies of them
(`CP_COMPILE_GE_CONVERTERS=DIR`), or, under `--mutations`, the library's with one
piece of text replaced (tests/ops/test_ge_value_mutations.py). Converter modules
import each other (`from cp_compile.ops.core.ge_util import scatter_into`), so loading the
mutated module alone is not enough: a module that imported the function before would
keep the unmutated copy, and the check would test code that is not the mutated code.
So every load drops all converter modules from `sys.modules`, serves the replaced
source through a meta-path finder, and imports all of them again: each import of a
converter module, from whichever module, resolves to the copy under test.

Where the converters live is asked of one function, `converter_modules()`; a mutation
names a dotted module (or a file relative to the repository root), so nothing here
knows the folder layout of ops/.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.ge_check.op_graphs import run_op_graphs
from tools.ge_check.reading import FxRecorder, GraphResult

REPO = Path(__file__).resolve().parents[2]

# A folder holding (mutated) copies of the converter modules, laid out as below their
# common folder (today ops/: <family>/ge*.py, core/ge_*.py): loaded in place of the library's for a whole run.
CONVERTERS_ENV = "CP_COMPILE_GE_CONVERTERS"


def converter_modules() -> tuple[str, ...]:
    """Dotted names of every module holding GE converter code, helpers first (the
    import order): the ops catalog's list, the one place that knows where the
    converters are (each family's ge*.py, the helpers in ops/core)."""
    from cp_compile.ops.core.catalog import converter_modules as catalog_converter_modules

    return tuple(catalog_converter_modules())


def register_converters() -> None:
    """Register the converters of the modules now in `sys.modules` with torchair,
    again: `register_converters` is idempotent, so its memo is cleared first. torchair's
    registry is keyed by op, so registering again replaces the previous converter
    (`check_registered` verifies that)."""
    from cp_compile.ops.core import ge_registry

    ge_registry._registered.clear()
    ge_registry.register_converters()


def module_file(module: str) -> Path:
    """The source file of `module` (imports its parent packages, not the module)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise ValueError(f"{module}: no Python source file")
    return Path(spec.origin).resolve()


def resolve_target(target: str) -> str:
    """A mutation's target -> the converter module it names: a dotted module name, or
    a `.py` file relative to the repository root (or absolute)."""
    modules = converter_modules()
    if not target.endswith(".py"):
        if target not in modules:
            raise ValueError(f"{target}: not a converter module (converter_modules(): {', '.join(modules)})")
        return target
    path = (REPO / target).resolve()
    for module in modules:
        if module_file(module) == path:
            return module
    raise ValueError(f"{target}: not the file of a converter module ({', '.join(modules)})")


class MutationNotApplied(ValueError):
    """The mutation's text is not in its module exactly once (the row went stale)."""


def mutated_sources(target: str, old: str, new: str) -> dict[str, str]:
    """{module: source} with `old` replaced by `new` in the target module's source;
    {} (the library's converters) when `old` is empty, as for the control run."""
    if not old:
        return {}
    module = resolve_target(target)
    source = module_file(module).read_text()
    if source.count(old) != 1:
        raise MutationNotApplied(f"{old!r} occurs {source.count(old)} times in {module} "
                                 f"({module_file(module).relative_to(REPO)}), not once")
    return {module: source.replace(old, new)}


def folder_sources(folder: str | os.PathLike) -> dict[str, str]:
    """{module: source} of every converter module from copies in `folder`, each at its
    path below the converter modules' common folder (today ops/<family>/ge*.py)."""
    files = {module: module_file(module) for module in converter_modules()}
    common = Path(os.path.commonpath([f.parent for f in files.values()]))
    return {module: (Path(folder) / f.relative_to(common)).read_text() for module, f in files.items()}


class _ServedSource(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the modules of `sources` before the path finder and runs the served text
    as their code. `__file__` stays the library file's, so a traceback names the right
    module (its quoted lines are the file's, not the mutated text)."""

    def __init__(self, sources: dict[str, tuple[Path, str]]) -> None:
        self.sources = sources

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.sources:
            return None
        file = self.sources[fullname][0]
        package = [str(file.parent)] if file.name == "__init__.py" else None
        return importlib.util.spec_from_file_location(fullname, file, loader=self,
                                                      submodule_search_locations=package)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # the default module object

    def exec_module(self, module: types.ModuleType) -> None:
        file, source = self.sources[module.__spec__.name]
        exec(compile(source, str(file), "exec"), module.__dict__)


def load_converters(sources: dict[str, str]) -> None:
    """Import every converter module afresh, those in `sources` from the given text and
    the rest from their files, so that every module importing another sees the copy
    loaded now: nothing of an earlier load (a previous mutation) survives."""
    modules = converter_modules()
    unknown = sorted(set(sources) - set(modules))
    if unknown:
        raise ValueError(f"not converter modules: {unknown}")
    served = {module: (module_file(module), text) for module, text in sources.items()}
    for module in modules:
        sys.modules.pop(module, None)
        # `from package import module` reads the package attribute before sys.modules.
        parent, _, child = module.rpartition(".")
        if parent in sys.modules and getattr(sys.modules[parent], child, None) is not None:
            delattr(sys.modules[parent], child)
    finder = _ServedSource(served)
    sys.meta_path.insert(0, finder)
    try:
        for module in modules:
            importlib.import_module(module)
    finally:
        sys.meta_path.remove(finder)
    for module in sources:
        if sys.modules[module].__loader__ is not finder:
            raise RuntimeError(f"{module}: imported from its file, not from the served source")
    check_fresh(modules)


def check_fresh(modules: tuple[str, ...]) -> None:
    """Every function a converter module holds that was defined in a converter module
    is that module's current one (a stale copy of an earlier load fails here)."""
    for name in modules:
        for attr, value in vars(sys.modules[name]).items():
            owner = getattr(value, "__module__", None)
            if not isinstance(value, types.FunctionType) or owner not in modules or \
                    value.__qualname__ != value.__name__:
                continue
            if getattr(sys.modules[owner], value.__name__, None) is not value:
                raise RuntimeError(f"{name}.{attr} is a stale copy of {owner}.{value.__name__}")


def check_registered() -> None:
    """torchair's converter of every declared cp:: op is a function of a converter
    module as now loaded (registering again replaced the earlier one). Asked of the
    function itself (its module and name), so no module layout is assumed here."""
    import torch
    from torchair._ge_concrete_graph.fx2ge_converter import _get_converter

    from cp_compile.ops.core.catalog import OPS
    from cp_compile.ops.core.spec import GE

    modules = converter_modules()
    for decl in OPS:
        if not isinstance(decl.ge, GE):
            continue
        got = _get_converter(getattr(torch.ops.cp, decl.name.split("::", 1)[1]).default)
        got = getattr(got, "__wrapped__", got)  # torchair registers a functools.wraps wrapper
        owner = getattr(got, "__module__", None)
        if owner not in modules or getattr(sys.modules[owner], got.__name__, None) is not got:
            raise RuntimeError(f"torchair's converter of {decl.name} ({owner}.{getattr(got, '__name__', got)}) "
                               "is not a function of the converter modules as now loaded")


@dataclass
class Mutation:
    """One row of `--mutations`: the converter code `sources` ({} = the library's),
    checked on the op graph `op`."""

    name: str
    sources: dict[str, str]
    op: str


def read_mutations(spec: str | os.PathLike) -> tuple[list[Mutation], dict[str, str]]:
    """The JSON list at `spec`: rows [name, target, old, new, op] (target a dotted
    converter module or a repository file; old "" for the library's converters), or
    [name, folder, op] (a folder of copies, as CP_COMPILE_GE_CONVERTERS). Returns the
    rows that apply and {name: why} of those that do not."""
    rows, not_applied = [], {}
    for row in json.loads(Path(spec).read_text()):
        try:
            if len(row) == 3:
                name, folder, op = row
                rows.append(Mutation(name, folder_sources(folder), op))
            else:
                name, target, old, new, op = row
                rows.append(Mutation(name, mutated_sources(target, old, new), op))
        except (ValueError, OSError) as e:
            not_applied[row[0]] = f"{type(e).__name__}: {e}"
    return rows, not_applied


def run_mutations(rows: list[Mutation], recorder: FxRecorder) -> list[GraphResult]:
    """Each row in turn, in this process (one torch and torchair import for all rows,
    tests/ops/test_ge_value_mutations.py): its converter code loaded afresh and
    registered over the previous row's, then its op's graph checked. The process is left
    with the library's converters."""
    results = []
    try:
        for row in rows:
            load_converters(row.sources)
            register_converters()
            check_registered()
            for r in run_op_graphs(recorder, None, False, [row.op]):
                r.mutation = row.name
                results.append(r)
    finally:
        load_converters({})
        register_converters()
    return results
