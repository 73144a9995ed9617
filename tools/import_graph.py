"""Count the import structure of the installed library with grimp (import-linter's graph).

    .venv/bin/python -m tools.import_graph [--root DIR] [--old-layout]

Reports, for the `cp_compile` package as it installs (ops/ -> cp_compile.ops,
passes/ -> cp_compile.passes):
  - modules that sit in an import cycle (strongly connected components of the
    module-level import graph, size > 1) and the imports inside those cycles;
  - imports that point up the layer order (the order of pyproject.toml's layers
    contract; --old-layout maps the pre-issue-20 module names onto the same layers);
  - function-local imports of the project's own modules.

The graph is built from a scratch copy of the tree laid out the way setuptools
installs it, so the same script measures the old tree (where ops/ and passes/ were
mapped by package-dir) and the new one. It exists to give the before/after figures
of issue 20; CI's check is `lint-imports` (tests/test_layers.py).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.lint_layers import installed_layout

# Highest layer first. A module belongs to the first layer with a matching prefix.
LAYERS_NEW = [
    ("serving", ["cp_compile.serving", "cp_compile.testing"]),
    ("compiler", ["cp_compile.compiler"]),
    ("runtime", ["cp_compile.runtime"]),
    ("passes", ["cp_compile.passes"]),
    ("compositions", ["cp_compile.ops.parallel"]),
    ("ops", ["cp_compile.ops"]),
    ("base", ["cp_compile.base"]),
]
# Before issue 20: compositions in cp_compile/parallel, the context in cp_compile/context.py
# (the pass interface, now passes/context.py), CI checks inside the package.
LAYERS_OLD = [
    ("front ends", ["cp_compile.serving.hf", "cp_compile.testing", "cp_compile.ops.ge.check",
                    "cp_compile.ops.kernels.ascend_check"]),
    ("front door", ["cp_compile.backend", "cp_compile.compiler.decorator", "cp_compile.compiler.lowering", "cp_compile.runtime.metadata",
                    "cp_compile.runtime.kv_cache", "cp_compile.runtime.parallel_state", "cp_compile.base.comm_stats",
                    "cp_compile.runtime.o_proj_full_weight"]),
    ("passes", ["cp_compile.passes", "cp_compile.context"]),
    ("compositions", ["cp_compile.parallel"]),
    ("ops", ["cp_compile.ops"]),
    ("base", ["cp_compile.base.config"]),
]
OPTIONAL = ("torchair", "torch_npu", "triton", "transformers", "tqdm", "nixl")


def _layer(module: str, layers: list[tuple[str, list[str]]]) -> int | None:
    for i, (_, prefixes) in enumerate(layers):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def _sccs(graph) -> list[set[str]]:
    """Tarjan over the direct imports (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[set[str]] = []
    counter = 0
    for start in sorted(graph.modules):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.find_modules_directly_imported_by(nxt)))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = set()
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    comp.add(m)
                    if m == node:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def function_local_imports(pkg_root: Path) -> list[str]:
    hits = []
    for path in sorted(pkg_root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    if name.split(".")[0] in ("cp_compile", "examples", "tools"):
                        hits.append(f"{path.relative_to(pkg_root.parent)}:{node.lineno} {name}")
    return hits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--old-layout", action="store_true", help="map the pre-issue-20 module names onto the layers")
    args = ap.parse_args(argv)
    layers = LAYERS_OLD if args.old_layout else LAYERS_NEW
    with tempfile.TemporaryDirectory() as tmp:
        dest = installed_layout(args.root.resolve(), Path(tmp), with_front_ends=False)
        code = (
            "import sys, json, grimp\n"
            f"sys.path.insert(0, {str(dest)!r})\n"
            "g = grimp.build_graph('cp_compile', include_external_packages=False)\n"
            "print(json.dumps({m: sorted(g.find_modules_directly_imported_by(m)) for m in g.modules}))\n"
        )
        edges = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                          text=True).stdout)
        locals_ = function_local_imports(dest / "cp_compile")

    class _G:  # the two queries _sccs needs, over the json edges
        modules = set(edges)

        @staticmethod
        def find_modules_directly_imported_by(m: str) -> set[str]:
            return set(edges.get(m, ()))

    cycles = _sccs(_G)
    in_cycle = set().union(*cycles) if cycles else set()
    cyclic_edges = [(a, b) for a in sorted(edges) for b in edges[a] if a in in_cycle and b in in_cycle
                    and any(a in c and b in c for c in cycles)]
    upward = []
    for a in sorted(edges):
        la = _layer(a, layers)
        for b in edges[a]:
            lb = _layer(b, layers)
            if la is not None and lb is not None and lb < la:
                upward.append(f"{a} -> {b}  ({layers[la][0]} -> {layers[lb][0]})")
    print(f"modules: {len(edges)}, imports: {sum(len(v) for v in edges.values())}")
    print(f"modules in import cycles: {len(in_cycle)} (in {len(cycles)} cycle(s)), imports inside cycles: "
          f"{len(cyclic_edges)}")
    for c in cycles:
        print("  cycle:", ", ".join(sorted(c)))
    print(f"upward imports (lower layer imports a higher one): {len(upward)}")
    for line in upward:
        print("  ", line)
    print(f"function-local imports of the project's own modules: {len(locals_)}")
    for line in locals_:
        print("  ", line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
