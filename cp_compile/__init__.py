"""cp-compile: decode context parallel (DCP) as a torch.compile backend.

Public API: `CPConfig`, `ConfigError`, `AttentionSpec`, `init_parallel`,
`destroy_parallel`, `get_parallel_state`, `allocate_kv_cache`,
`build_attention_metadata`, `BlockAllocator`; the offline front end `LLM`, `SamplingParams`
(cp_compile/serving/entrypoints/, docs/hf.md); `cp-compile serve` (cp_compile/serving/entrypoints/server.py).
Custom ops live in `cp_compile.ops`, graph rewrites in `cp_compile.passes`.

The package is laid out by layer (docs/architecture.md §2): `base` (config, errors,
layout, sampling, cost models) < `ops` < `passes` < `runtime` (metadata, KV cache,
parallel state) < `compiler` (backend, decorator, lowering, step check) < `serving`
(engine, driver, LLM, server, speculative decoding, KV transfer). This module is lazy
(PEP 562): `import cp_compile.base.errors` or `import cp_compile.base.config` loads
neither the serving stack nor the compile machinery; a public name is imported from
its layer on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "AttentionSpec": "cp_compile.base.config",
    "ConfigError": "cp_compile.base.config",
    "CPConfig": "cp_compile.base.config",
    "RequestError": "cp_compile.base.sampling",
    "SamplingParams": "cp_compile.base.sampling",
    "KVCache": "cp_compile.runtime.kv_cache",
    "KVCacheSpec": "cp_compile.runtime.kv_cache",
    "allocate_kv_cache": "cp_compile.runtime.kv_cache",
    "AttentionMetadata": "cp_compile.runtime.metadata",
    "BlockAllocator": "cp_compile.runtime.metadata_build",
    "CapacityError": "cp_compile.base.errors",
    "MetadataError": "cp_compile.base.errors",
    "build_attention_metadata": "cp_compile.runtime.metadata_build",
    "validate_step": "cp_compile.runtime.metadata_checks",
    "ParallelState": "cp_compile.runtime.parallel_state",
    "destroy_parallel": "cp_compile.runtime.parallel_state",
    "get_parallel_state": "cp_compile.runtime.parallel_state",
    "init_parallel": "cp_compile.runtime.parallel_state",
    "CpAscendBackend": "cp_compile.compiler.backend",
    "backend": "cp_compile.compiler.backend",
    "compile_model": "cp_compile.compiler.decorator",
    "cp_module": "cp_compile.compiler.decorator",
    "LLM": "cp_compile.serving.entrypoints.llm",
    "CompletionOutput": "cp_compile.serving.entrypoints.llm",
    "RequestOutput": "cp_compile.serving.entrypoints.llm",
}

# the subpackages: `cp_compile.passes.context` works after a bare `import cp_compile`,
# as it did when this module imported everything
_SUBPACKAGES = frozenset({"base", "runtime", "compiler", "serving", "testing", "ops", "passes"})

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"cp_compile.{name}")  # sets the attribute itself
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'cp_compile' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | _SUBPACKAGES)
