"""Triton kernels written once for Triton and Triton-Ascend (docs/architecture.md §8).

Importable without triton: `triton_available()` says whether the launchers can be
used; touching a launcher without triton raises ImportError. Each launcher takes
torch tensors and returns new tensors; CPU tensors run only under TRITON_INTERPRET=1
(set before triton is first imported), which is how the tests check them.

- `paged_attention_with_lse_triton`  (paged_decode_lse.py)
- `merge_partials_triton`, `lse_rescale_triton`  (lse_merge.py)
- `local_slot_mapping_triton`  (localize_slots.py)
- `paged_prefill_attention_lse_triton`  (paged_prefill.py: query-tiled prefill over a paged cache)
- `cache_write_triton`  (cache_write.py)
- `mla_preprocess_tail_triton`, `mla_preprocess_device`  (mla_preprocess_tail.py: MLAPO norm + rope + cache write)
- `sparse_mla_rows_triton`  (sparse_mla.py)
- `index_scores_triton`, `indexer_topk_rows`  (lightning_indexer.py)
- `int8_matmul_triton`  (int8_matmul.py)

and, next to each launcher, the `*_device` functions registered as the cp:: ops'
accelerator kernels (declared by the op family modules, `kernels/launch.py` adapts the launchers).

Each kernel module also declares `LOWERING` (`_common.LoweringDeclaration`): the
launches the Triton-Ascend lowering check compiles (`python -m
tools.ascend_check`, in .venv-ascend).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

_LAUNCHERS = {
    "paged_attention_with_lse_triton": "paged_decode_lse",
    "merge_partials_triton": "lse_merge",
    "lse_rescale_triton": "lse_merge",
    "local_slot_mapping_triton": "localize_slots",
    "paged_prefill_attention_lse_triton": "paged_prefill",
    "cache_write_triton": "cache_write",
    "cache_write_device": "cache_write",
    "sparse_mla_rows_triton": "sparse_mla",
    "sparse_mla_partial_attention_device": "sparse_mla",
    "sparse_mla_rows_attention_device": "sparse_mla",
    "sparse_mla_attention_device": "sparse_mla",
    "index_scores_triton": "lightning_indexer",
    "indexer_topk_rows": "lightning_indexer",
    "lightning_indexer_device": "lightning_indexer",
    "lightning_indexer_topk_rows_device": "lightning_indexer",
    "int8_matmul_triton": "int8_matmul",
    "w8a8_dynamic_linear_device": "int8_matmul",
    "mla_preprocess_tail_triton": "mla_preprocess_tail",
    "mla_preprocess_device": "mla_preprocess_tail",
    "w8a8_static_linear_device": "int8_matmul",
}

__all__ = ["triton_available", *_LAUNCHERS]


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


def __getattr__(name: str) -> Any:
    # Lazy: importing cp_compile.ops.kernels must not import triton (nor fix the
    # TRITON_INTERPRET mode) until a launcher is actually asked for.
    module = _LAUNCHERS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not triton_available():
        raise ImportError(f"{name} needs triton (pip install triton, or triton-ascend on NPU)")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
