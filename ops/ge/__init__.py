"""GE converters for every `cp::*` op (torchair `max-autotune`, NPU graph mode).

One module per op family: `cache` (metadata localisation, cache writes),
`attention` (paged attention with LSE, single-device GQA / MLA, varlen causal),
`merge` (LSE merges), `sparse` (lightning indexer, sparse MLA, the SFA DCP ops), `dsa_cp`
(the DSA-CP token-shard indexer and sparse MLA), `quant` (the W8A8 linears), `mla_preprocess`
(MLAPO, primitives: why not CANN's MlaProlog is in its docstring). The mapping of each
op to CANN operators, and why, is in docs/torchair.md and each module's docstring.

Importing this package imports no torchair; `register_converters()` does, lazily
(torchair exists only with torch-npu). The `_c10d_functional` collectives use
torchair's own converters (HcomAllGather / HcomReduceScatter / HcomAllToAllV,
group from the process group's tag and rank list); `python -m
tools.ge_check` checks them.
"""

from __future__ import annotations

import importlib

MODULES = ("cache", "attention", "merge", "sparse", "dsa_cp", "quant", "mla_preprocess")

# Every cp:: op the project defines -> the GE op types its converter emits (the
# check compares this with the ops registered in the `cp` namespace and with what
# the converted graphs contain).
GE_OPS = {
    "cp::dcp_localize_metadata": ("FloorDiv", "FloorMod", "SelectV2"),
    "cp::cache_write": ("ScatterNdUpdate",),
    "cp::paged_attention_lse": ("FusedInferAttentionScore",),
    "cp::mla_partial_attention": ("FusedInferAttentionScore",),
    "cp::varlen_causal_attention_lse": ("FusedInferAttentionScore",),
    "cp::gqa_paged_attention": ("ScatterNdUpdate", "FusedInferAttentionScore"),
    "cp::mla_attention": ("ScatterNdUpdate", "FusedInferAttentionScore"),
    "cp::lse_rescale": ("ReduceMaxD", "Exp", "Log", "SelectV2"),
    "cp::lse_combine": ("AttentionUpdate",),
    "cp::lightning_indexer": ("ScatterNdUpdate", "LightningIndexer"),
    "cp::sparse_mla_attention": ("ScatterNdUpdate", "SparseFlashAttention"),
    "cp::sparse_mla_partial_attention": ("SparseFlashAttention",),
    "cp::dcp_sparse_indices": ("Sort", "GatherElements"),
    "cp::lightning_indexer_topk_rows": ("Cumsum", "LightningIndexer", "SelectV2"),
    "cp::sparse_mla_rows_attention": ("Cumsum", "SparseFlashAttention", "SelectV2"),
    "cp::w8a8_dynamic_linear": ("ReduceMaxD", "Round", "QuantBatchMatmulV3", "ReduceSumD"),
    "cp::w8a8_static_linear": ("Round", "QuantBatchMatmulV3", "ReduceSumD"),
    "cp::mla_preprocess": ("MatMulV2", "Rsqrt", "BatchMatMulV2", "ScatterNdUpdate"),
}

_registered = False


def register_converters() -> list[str]:
    """Import the converter modules (registers them with torchair); idempotent.
    Raises ImportError when torchair is not importable."""
    global _registered
    import torchair  # noqa: F401  (fail early and clearly)

    for name in MODULES:
        importlib.import_module(f"{__name__}.{name}")
    _registered = True
    return sorted(GE_OPS)
