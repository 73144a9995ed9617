"""Attention functions registered with `transformers.AttentionInterface`.

HF calls `fn(module, query[1, Hq, T, D], key, value, attention_mask, scaling=...,
**kwargs)` and expects `([1, T, Hq, Dv], None)`. Tokens are flattened (batch 1,
T = all requests' new tokens), so the global `AttentionMetadata` (`cp_meta`) tells
the op where each request starts and which paged slots it owns; HF's mask is None
(our names have no mask function). Each function makes exactly one
`cp::gqa_paged_attention` / `cp::mla_attention` call, which the DCP pass rewrites;
over a quantised cache (`CPConfig.kv_cache_dtype`, issue 39: the layer's caches carry
their scale caches) the `_quant` op instead, with the layer's static scales where the
checkpoint gave them (`kv_scales.attach`, decision 71).
"""

from __future__ import annotations

from typing import Any

import torch

import cp_compile.ops  # noqa: F401  (registers torch.ops.cp.*)
from cp_compile.serving.hf.cache import MLA_NEW_KEY
from cp_compile.ops.parallel.dcp import dense
from cp_compile.serving.hf.kv_scales import STATIC_SCALE_ATTRS

GQA_NAME = "cp_gqa_paged"
MLA_NAME = "cp_mla_latent"


def _layer_inputs(module: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[tuple[torch.Tensor, ...], Any]:
    try:
        caches, meta = kwargs["cp_kv_caches"], kwargs["cp_meta"]
    except KeyError as e:
        raise TypeError(f"cp_compile.serving.hf attention needs model kwarg {e.args[0]!r}; call the model through "
                        "cp_compile.serving.hf.Engine (it passes cp_kv_caches= and cp_meta=)") from None
    return caches[module.layer_idx], meta


def static_scales(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The layer's static KV scales as the quant ops' keyword arguments (none: dynamic scales)."""
    return {name: getattr(module, attr) for name, attr in STATIC_SCALE_ATTRS.items()
            if getattr(module, attr, None) is not None}


def gqa_paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                        sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    if sliding_window is not None:
        raise ValueError(f"layer {module.layer_idx}: sliding_window={sliding_window} is not served "
                         "(cp_compile.serving.hf.check_supported refuses such models)")
    (k_cache, v_cache, *scale_caches), meta = _layer_inputs(module, kwargs)  # + (k_scale, v_scale): quantised
    q = query[0].transpose(0, 1)  # [T, Hq, D]
    k = key[0].transpose(0, 1)  # [T, Hkv, D]  this step's keys (PagedCache.update returned them)
    v = value[0].transpose(0, 1)  # [T, Hkv, Dv]
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if scale_caches:
        statics = {n: s for n, s in static_scales(module).items() if n in ("k_static_scale", "v_static_scale")}
        out = torch.ops.cp.gqa_paged_attention_quant(dense(q), dense(k), dense(v), k_cache, v_cache, *scale_caches,
                                                     meta.slot_mapping, meta.block_table, meta.seq_lens,
                                                     meta.query_start_loc, scale, **statics)  # [T, Hq, Dv]
    else:
        out = torch.ops.cp.gqa_paged_attention(dense(q), dense(k), dense(v), k_cache, v_cache,
                                               meta.slot_mapping, meta.block_table, meta.seq_lens,
                                               meta.query_start_loc, scale)  # [T, Hq, Dv]
    return out.unsqueeze(0), None


def mla_latent_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Absorbed MLA over the latent cache. HF's per-head `key` / `value` are ignored:
    scores q_nope . (W_UK c) = (q_nope W_UK) . c, and the output W_UV (P c), so the
    cache holds only [c; k_pe] (kv_lora_rank + rope dims per token)."""
    (kv_cache, *scale_caches), meta = _layer_inputs(module, kwargs)  # + (latent_scale,): quantised
    try:
        kv_c, k_pe = kwargs[MLA_NEW_KEY]  # [1, 1, T, L], [1, 1, T, R]
    except KeyError:
        raise TypeError("cp_compile.serving.hf MLA attention: the model did not call cache.update with the latent; "
                        "pass cache=cp_compile.serving.hf.PagedCache()") from None
    nope, rope, vdim = module.qk_nope_head_dim, module.qk_rope_head_dim, module.v_head_dim
    lat = kv_c.shape[-1]
    w = module.kv_b_proj.weight.view(-1, nope + vdim, lat)  # [H, nope + v, L] (this rank's heads)
    w_uk, w_uv = w[:, :nope], w[:, nope:]  # [H, nope, L], [H, v, L]
    q = query[0].transpose(0, 1)  # [T, H, nope + R]
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    q_abs = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, H, L]
    scale = scaling if scaling is not None else (nope + rope) ** -0.5
    if scale_caches:
        statics = {n: s for n, s in static_scales(module).items() if n == "kv_static_scale"}
        latent = torch.ops.cp.mla_attention_quant(dense(q_abs), dense(q_pe), dense(kv_c[0, 0]), dense(k_pe[0, 0]),
                                                  kv_cache, *scale_caches, meta.slot_mapping, meta.block_table,
                                                  meta.seq_lens, meta.query_start_loc, scale, **statics)  # [T, H, L]
    else:
        latent = torch.ops.cp.mla_attention(dense(q_abs), dense(q_pe), dense(kv_c[0, 0]),
                                            dense(k_pe[0, 0]), kv_cache, meta.slot_mapping, meta.block_table,
                                            meta.seq_lens, meta.query_start_loc, scale)  # [T, H, L]
    out = torch.einsum("thl,hvl->thv", latent, w_uv)  # [T, H, v]
    return out.unsqueeze(0), None


_registered = False


def register() -> None:
    """Register both functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    import transformers

    transformers.AttentionInterface.register(GQA_NAME, gqa_paged_attention)
    transformers.AttentionInterface.register(MLA_NAME, mla_latent_attention)
    _registered = True
