"""Which converter code the check runs: the library's, or copies of ops/ge/*.py from
a folder (`CP_COMPILE_GE_CONVERTERS=DIR`, and `--mutations`, the mutation test)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from tools.ge_check.op_graphs import run_op_graphs
from tools.ge_check.reading import FxRecorder, GraphResult

# A folder holding (mutated) copies of ops/ge/*.py: loaded in place of the library's
# converter modules, for the mutation test (tests/ops/test_ge_value_mutations.py).
CONVERTERS_ENV = "CP_COMPILE_GE_CONVERTERS"


def load_converters(folder: str | None) -> None:
    """Import the converter modules from `folder` under their library names (so the
    library's `register_converters` finds them already imported)."""
    if not folder:
        return
    from cp_compile.ops import ge as ge_pkg

    for name in ("_util",) + ge_pkg.MODULES + ge_pkg.ATEN_MODULES:
        full = f"{ge_pkg.__name__}.{name}"
        spec = importlib.util.spec_from_file_location(full, Path(folder) / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[full] = module
        spec.loader.exec_module(module)


def run_mutations(spec: str, recorder: FxRecorder) -> list[GraphResult]:
    """Each (name, converter folder, op) of the JSON list `spec` in turn, in this process:
    the folder's converter modules replace the registered ones (torchair's registry is a
    dict keyed by op: registering again overrides), then that op's graph is checked.
    One process for every mutation (tests/ops/test_ge_value_mutations.py): one torch and
    torchair import instead of one per mutation."""
    from cp_compile.ops import ge as ge_pkg

    results = []
    for name, folder, op in json.loads(Path(spec).read_text()):
        load_converters(folder)
        ge_pkg._registered.clear()
        ge_pkg.register_converters()
        for r in run_op_graphs(recorder, None, False, [op]):
            r.mutation = name
            results.append(r)
    return results
