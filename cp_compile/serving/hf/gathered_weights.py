"""The weights the merge rewrites gather, charged against the KV budget (issue 37, decision 73).

The all-reduce fold (decision 62) holds the o_proj columns of the DCP group's other ranks'
heads (MLA / SFA: and their W_UV) as buffers; project before the merge (decision 61) holds
the other cp ranks' W_UV. Both are gathered at the first compile, after the engine sized its
KV pool, so the bytes are computed here from the model config alone (the shapes the passes
gather, per compiled graph) and taken out of `kv_cache_memory_bytes` before the blocks are
counted (`kv_budget.plan_pool(reserved_bytes=...)`).

Per rank, per layer, with h = heads per TP rank, Dv the V head dim, L the latent, b the
weight dtype's bytes, N = dcp (the fold, pcp = 1) or pcp * dcp (projection):

    fold        (N - 1) * hidden * h * Dv * b   (+ MLA / SFA: (N - 1) * h * L * Dv * b)
    projection  (N - 1) * h * L * Dv * b        (MLA / SFA only)

A folded merge is not projected (the fold erases it and projects itself), so the charge is
the larger of the two that can be taken:
- "on": taken wherever the layout allows it (the fold: tp > 1, dcp > 1, pcp = 1; the
  projection: MLA / SFA at pcp * dcp > 1); a graph the pass cannot prove raises at compile.
- "auto": the cost model may take it, so it is reserved (an upper bound: the choice may not
  take it), except the fold where its bytes exceed `FOLD_KV_FRACTION` of the budget: the pass
  never takes it then (its rule compares them with the graph's KV bytes, at most the budget).
- "off": nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_compile.base.config import CPConfig
from cp_compile.base.merge_cost import FOLD_KV_FRACTION
from cp_compile.serving.hf.support import attention_spec, head_dim


def _per_layer(cfg: CPConfig, hf_config: Any) -> tuple[int, int]:
    """(o_proj columns, W_UV) elements of this rank's heads, one layer."""
    spec = attention_spec(hf_config)
    h = hf_config.num_attention_heads // cfg.tensor_parallel_size
    if spec.kind in ("mla", "sfa"):
        dv = hf_config.v_head_dim
        return hf_config.hidden_size * h * dv, h * hf_config.kv_lora_rank * dv
    return hf_config.hidden_size * h * head_dim(hf_config), 0


def fold_bytes(cfg: CPConfig, hf_config: Any, dtype: torch.dtype) -> int:
    """What the all-reduce fold gathers on this rank over every layer (0 where the layout has no
    fold: tp = 1, dcp = 1, or pcp > 1)."""
    n = cfg.decode_context_parallel_size
    if cfg.tensor_parallel_size == 1 or n == 1 or cfg.prefill_context_parallel_size > 1:
        return 0
    o_proj, w_uv = _per_layer(cfg, hf_config)
    return hf_config.num_hidden_layers * (n - 1) * (o_proj + w_uv) * dtype.itemsize


def projection_bytes(cfg: CPConfig, hf_config: Any, dtype: torch.dtype) -> int:
    """What project before the merge gathers on this rank over every layer (0 for GQA)."""
    n = cfg.context_parallel_size
    _, w_uv = _per_layer(cfg, hf_config)
    return hf_config.num_hidden_layers * (n - 1) * w_uv * dtype.itemsize


def gathered_weight_bytes(cfg: CPConfig, hf_config: Any, dtype: torch.dtype,
                          kv_cache_memory_bytes: int | None = None) -> int:
    """The bytes to reserve on this rank for the rewrites `cfg` may take (module docstring)."""
    fold = fold_bytes(cfg, hf_config, dtype) if cfg.dcp_merge_fold != "off" else 0
    if cfg.dcp_merge_fold == "auto" and kv_cache_memory_bytes is not None and (
            fold > FOLD_KV_FRACTION * kv_cache_memory_bytes):
        fold = 0
    proj = projection_bytes(cfg, hf_config, dtype) if cfg.dcp_project_before_merge != "off" else 0
    return max(fold, proj)


__all__ = ["fold_bytes", "projection_bytes", "gathered_weight_bytes"]
