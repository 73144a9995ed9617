"""Import the repository as laid out, with nothing installed (the bare GPU machine).

pyproject installs `ops/` as `cp_compile.ops` and `passes/` as `cp_compile.passes`
(package_dir). A plain checkout has `cp_compile/` at the root but no
`cp_compile/ops`, so `import cp_compile.ops` fails there. This finder maps exactly
those two package names to their folders; every submodule then resolves through
the package's `__path__`. It is installed only when the name does not resolve
already (an editable or regular install wins), and lives in tools/, never in the
library.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FOLDERS = {"cp_compile.ops": "ops", "cp_compile.passes": "passes"}


class RepoFolders(importlib.abc.MetaPathFinder):
    """`cp_compile.ops` -> REPO/ops, `cp_compile.passes` -> REPO/passes."""

    def find_spec(self, name: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        folder = FOLDERS.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, REPO / folder / "__init__.py",
                                                      submodule_search_locations=[str(REPO / folder)])


def ensure_repo_importable() -> str:
    """Put the repository root on sys.path and map the two folders if needed; returns
    how `cp_compile.ops` resolves ("installed" or "repo-root shim"). Raises ImportError
    naming the missing module when torch or triton is absent."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    for needed in ("torch", "triton"):
        if importlib.util.find_spec(needed) is None:
            raise ImportError(f"No module named {needed!r}: the check needs only torch, triton and this repository")
    if any(isinstance(f, RepoFolders) for f in sys.meta_path):
        return "repo-root shim"
    if importlib.util.find_spec("cp_compile.ops") is not None:
        return "installed"
    sys.meta_path.insert(0, RepoFolders())
    return "repo-root shim"
