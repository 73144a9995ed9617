"""Check the layers contract of pyproject.toml ([tool.importlinter]) with lint-imports.

    .venv/bin/python -m tools.lint_layers [--root DIR]

grimp (import-linter's graph builder) finds a package's modules by walking its
folder, and `ops/` and `passes/` install into `cp_compile` through setuptools'
package-dir, so the check runs `lint-imports` on a scratch copy of the tree laid
out as installed (`cp_compile/ops`, `cp_compile/passes`; `examples/`, `tools/`
beside it), with the repository's pyproject.toml as its config. Exit status: that
of lint-imports (0 kept, 1 broken). tests/test_layers.py runs it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
_IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc")


def installed_layout(root: Path, dest: Path, *, with_front_ends: bool = True) -> Path:
    """Copy `root`'s packages into `dest` the way they install; returns `dest`."""
    pkg = dest / "cp_compile"
    shutil.copytree(root / "cp_compile", pkg, ignore=_IGNORE)
    for name in ("ops", "passes"):
        shutil.copytree(root / name, pkg / name, ignore=_IGNORE)
    if with_front_ends:
        for name in ("examples", "tools"):
            shutil.copytree(root / name, dest / name, ignore=_IGNORE)
    return dest


def lint(root: Path, scratch: Path, edit: Callable[[Path], None] | None = None) -> subprocess.CompletedProcess:
    """lint-imports over the installed layout of `root`, in `scratch` (an empty folder).
    `edit(scratch)` may change the copy first (the test injects a violation that way)."""
    installed_layout(root, scratch)
    if edit is not None:
        edit(scratch)
    exe = Path(sys.executable).with_name("lint-imports")
    # cwd first on sys.path, so `cp_compile` is the scratch copy, not the editable install.
    env = dict(os.environ, PYTHONPATH=str(scratch))
    return subprocess.run([str(exe), str(root / "pyproject.toml"), "--no-cache"], cwd=scratch, env=env,
                          capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=REPO, help="the repository to check (default: this one)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        proc = lint(args.root.resolve(), Path(tmp))
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
