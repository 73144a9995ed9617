"""The parallel state reaches the compile and runtime paths as an argument (issue 20).

`parallel_state_or_none()` / `get_parallel_state()` (the module global of
`init_parallel`) may be read only at a front door, once, when the caller passed no
state (`parallel=None`): the backend factory and the argument-less `cp_ascend` entry,
the compiled entry's first call, `allocate_kv_cache`, the eager `validate_step` and
`hf.Engine`. Everything those call gets the state (or its layout) as an argument.
test_backend_front_door.py checks the compile path by making the global unreadable;
here the same for the runtime path, and a scan of the whole library for any other read.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import cp_compile
from cp_compile.base.parallel_layout import Layout

REPO = Path(__file__).resolve().parents[2]
READS = {"parallel_state_or_none", "get_parallel_state"}
# (file, function) of every allowed read: the front doors of the module docstring.
FRONT_DOORS = {
    ("cp_compile/compiler/backend.py", "backend"), ("cp_compile/compiler/backend.py", "cp_ascend"),
    ("cp_compile/compiler/decorator.py", "CompiledForward._setup"), ("cp_compile/runtime/kv_cache.py", "allocate_kv_cache"),
    ("cp_compile/runtime/metadata_checks.py", "validate_step"), ("cp_compile/serving/hf/engine.py", "Engine.__init__"),
}


def global_reads(root: Path = REPO) -> set[tuple[str, str]]:
    """(file, qualified function) of every call of a READS function in the installed
    library (cp_compile/, ops/, passes/), but parallel_state.py, which defines them."""
    found = set()
    for path in sorted(p for d in ("cp_compile", "ops", "passes") for p in (root / d).rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "cp_compile/runtime/parallel_state.py":
            continue

        def visit(node: ast.AST, scope: tuple[str, ...]) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    visit(child, scope + (child.name,))
                    continue
                if isinstance(child, ast.Call):
                    f = child.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    if name in READS:
                        found.add((rel, ".".join(scope) or "<module>"))
                visit(child, scope)

        visit(ast.parse(path.read_text()), ())
    return found


def test_only_front_doors_read_the_parallel_global() -> None:
    reads = global_reads()
    assert reads - FRONT_DOORS == set(), (
        f"read the parallel-state global off a front door: {sorted(reads - FRONT_DOORS)}. Fix: take the state as "
        "a parameter (parallel=) from the entry that has it")
    assert FRONT_DOORS - reads == set(), f"front doors that no longer read it (drop them here): {FRONT_DOORS - reads}"


def test_the_scan_finds_an_injected_read(tmp_path: Path) -> None:
    """The scan is not vacuous: a global read added to check_dcp_layout (off the front door) is found."""
    for d in ("cp_compile/runtime", "ops", "passes"):
        (tmp_path / d).mkdir(parents=True)
    src = (REPO / "cp_compile/runtime/kv_cache.py").read_text()
    anchor = "    n = cfg.context_parallel_size\n    if parallel is None or n == 1:\n"
    assert src.count(anchor) == 1
    (tmp_path / "cp_compile/runtime/kv_cache.py").write_text(src.replace(anchor, "    parallel = parallel_state_or_none()\n"
                                                                 + anchor))
    assert ("cp_compile/runtime/kv_cache.py", "check_dcp_layout") in global_reads(tmp_path)


def test_runtime_path_uses_the_state_it_was_given(monkeypatch) -> None:
    """allocate_kv_cache(parallel=) and validate_step(parallel=) with the global unreadable:
    the layout check gathers over the given state's cp group, the KV heads are its TP
    rank's, and the step is validated at its cp size."""
    def no_global():
        raise AssertionError("the runtime path read the parallel-state global")

    kv_cache, checks = (importlib.import_module(f"cp_compile.runtime.{m}") for m in ("kv_cache", "metadata_checks"))
    for module in (kv_cache, checks, cp_compile.runtime.parallel_state):
        monkeypatch.setattr(module, "parallel_state_or_none", no_global)
    cfg = cp_compile.CPConfig(tensor_parallel_size=4, decode_context_parallel_size=2, block_size=4)
    cp_group = object()  # stands for the live process group: the all-gather below is recorded, not run
    state = SimpleNamespace(cfg=cfg, layout=Layout.for_test(cfg, rank=3), cp_group=cp_group)
    gathered = []

    def all_gather_object(out, mine, group):
        gathered.append(group)
        out[:] = [mine] * len(out)

    monkeypatch.setattr(kv_cache.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(kv_cache.dist, "get_process_group_ranks", lambda group: [1, 3])
    spec = cp_compile.KVCacheSpec(num_layers=1, kind="gqa", head_dim=8, num_kv_heads_per_rank=1)
    cache = cp_compile.allocate_kv_cache(cfg, spec, 4, attention=cp_compile.AttentionSpec("gqa", 8, 2),
                                         parallel=state)
    assert gathered == [cp_group]
    alloc = cp_compile.BlockAllocator(4, cfg.virtual_block_size)
    meta = cp_compile.build_attention_metadata([(0, 3 * cfg.virtual_block_size)], alloc)  # 3 of the 4 blocks
    cp_compile.validate_step(meta, cache.layers, parallel=state)  # cp = 2 from the state: fits
    with pytest.raises(cp_compile.MetadataError):
        cp_compile.validate_step(meta, cache.layers, cp=1)  # the same step read at cp 1 overflows the shard
    # Without a state, allocate_kv_cache is the front door: it reads the global (here: raises).
    with pytest.raises(AssertionError, match="read the parallel-state global"):
        cp_compile.allocate_kv_cache(cfg, spec, 4)
