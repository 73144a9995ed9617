"""The layers contract (pyproject.toml [tool.importlinter], docs/architecture.md §2).

lint-imports runs on the installed layout (tools/lint_layers.py) and must keep the
contract; the same run on a copy with one upward import injected must break it (so
the check can fail); every library module sits in a layer; the library imports its
own modules only at module level (function-local imports are for optional
dependencies); `import ops` / `import passes` from the repository root refuse to
load a second copy.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from tools.import_graph import function_local_imports
from tools.lint_layers import REPO, installed_layout, lint


def test_layers_contract_is_kept(tmp_path: Path, summary_note) -> None:
    proc = lint(REPO, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Contracts: 1 kept, 0 broken." in proc.stdout, proc.stdout
    summary_note("layers contract: " + next(line for line in proc.stdout.splitlines() if "Analyzed" in line)
                 + " 1 kept, 0 broken")


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    def inject(scratch: Path) -> None:  # an op module reaching up to the front door
        layout = scratch / "cp_compile" / "ops" / "core" / "layout.py"
        layout.write_text(layout.read_text() + "\nfrom cp_compile.compiler.backend import CpAscendBackend  # noqa\n")

    proc = lint(REPO, tmp_path, edit=inject)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 broken" in proc.stdout, proc.stdout
    assert "cp_compile.ops.core.layout -> cp_compile.compiler.backend" in proc.stdout, proc.stdout


def test_every_library_module_is_in_a_layer(tmp_path: Path) -> None:
    layers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    prefixes = [name.strip() for layer in layers for name in layer.replace("|", ":").split(":")]
    root = installed_layout(REPO, tmp_path, with_front_ends=False)
    missing = []
    for path in sorted((root / "cp_compile").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        # the packages that hold layers (their __init__ is a docstring, cp_compile's is lazy;
        # ops/core's modules sit in two layers: the catalog above the families, the rest below)
        if module in ("cp_compile", "cp_compile.ops", "cp_compile.ops.core", "cp_compile.base", "cp_compile.serving"):
            continue
        if not any(module == p or module.startswith(p + ".") for p in prefixes):
            missing.append(module)
    assert not missing, f"modules in no layer of pyproject.toml's contract: {missing}. Fix: add each to its layer"


def test_library_imports_its_own_modules_at_module_level(tmp_path: Path) -> None:
    root = installed_layout(REPO, tmp_path, with_front_ends=False)
    assert function_local_imports(root / "cp_compile") == []


def test_library_has_no_stand_in_branch() -> None:
    hits = [str(p.relative_to(REPO)) for d in ("cp_compile", "ops", "passes") for p in (REPO / d).rglob("*.py")
            if "CP_COMPILE_STANDIN" in p.read_text() or "torchair_standin" in p.read_text()]
    assert hits == [], f"the installed library mentions the torchair stand-in (tools/torchair_standin.py): {hits}"


def test_top_level_ops_and_passes_refuse_to_load() -> None:
    for name in ("ops", "passes"):
        proc = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode != 0
        assert "ImportError" in proc.stderr and f"Fix: `import cp_compile.{name}`" in proc.stderr, proc.stderr
