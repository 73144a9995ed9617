"""Which Hugging Face models `cp_compile.serving.hf` can serve exactly, checked at load.

DCP shards each layer's KV cache by tokens and merges partial attentions with
their log-sum-exp; that is exact for full causal softmax attention over one paged
cache per layer, and nothing else we have an op for. Anything else is refused by
name, with the fix, before a cache is allocated or a graph traced.
"""

from __future__ import annotations

from typing import Any

from cp_compile.base.config import AttentionSpec, ConfigError

# model_type -> attention kind served. GQA: one K and one V head set per layer;
# MLA: DeepSeek-V3-style latent attention (kv_b_proj absorbed at run time).
SUPPORTED: dict[str, str] = {
    "qwen3": "gqa", "qwen2": "gqa", "llama": "gqa", "mistral": "gqa", "qwen3_moe": "gqa",
    "deepseek_v3": "mla", "deepseek_v2": "mla",
    # SFA: MLA + lightning indexer (DeepSeek Sparse Attention), routed by cp_compile/serving/hf/sfa.py.
    "deepseek_v32": "sfa", "glm_moe_dsa": "sfa",
}


class UnsupportedModelError(ConfigError):
    """An HF model feature cp_compile.serving.hf cannot serve exactly (names the feature)."""


def _refuse(feature: str, got: str, fix: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"cp_compile.serving.hf serves the model's {feature}", got, fix)


def check_supported(config: Any) -> str:
    """Raise `UnsupportedModelError` naming the first feature of `config` (an HF
    `PretrainedConfig`) that DCP cannot serve exactly; return the attention kind.

    Order matters only for models with several: the feature that changes the
    softmax itself (capping, sinks, linear layers) is named before the window."""
    mt = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        raise _refuse("encoder-decoder attention", f"model_type={mt!r}, is_encoder_decoder=True",
                      "serve a decoder-only causal LM (cross-attention has no paged causal cache)")
    layer_types = list(getattr(config, "layer_types", None) or [])
    full = ("full_attention", "sliding_attention") + (("indexed_attention",) if SUPPORTED.get(mt) == "sfa" else ())
    linear = sorted({t for t in layer_types if t not in full})
    if linear or getattr(config, "linear_num_key_heads", None) is not None:
        raise _refuse("linear / hybrid attention", f"model_type={mt!r}, layer_types include {linear or 'linear'}",
                      "serve a model whose every layer is full softmax attention (no linear / state-space layers)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            raise _refuse("logit soft-capping", f"model_type={mt!r}, {name}={getattr(config, name)!r}",
                          "serve a model without soft-capping (tanh capping does not survive the LSE merge of "
                          "cp::gqa_paged_attention, which has no cap)")
    if getattr(config, "attention_sinks", None) or mt in ("gpt_oss",) or getattr(config, "num_sink_tokens", 0):
        raise _refuse("attention sinks", f"model_type={mt!r}",
                      "serve a model without learned sink logits (the paged ops have no sink term)")
    if "sliding_attention" in layer_types or (
            getattr(config, "sliding_window", None) is not None
            and getattr(config, "use_sliding_window", True) and mt != "qwen3" and mt != "qwen2"):
        raise _refuse("sliding window", f"model_type={mt!r}, sliding_window={getattr(config, 'sliding_window', None)!r}"
                      f", layer_types={sorted(set(layer_types)) or None}",
                      "set config.sliding_window=None (full attention) if the model was trained without it; "
                      "windowed attention is not served")
    if mt not in SUPPORTED:
        raise _refuse("architecture", f"model_type={mt!r}",
                      f"use one of {sorted(SUPPORTED)} (their attention modules call cache.update before the "
                      "attention function, which is how the paged cache reaches the op)")
    if SUPPORTED[mt] == "sfa":
        shared = [i for i, t in enumerate(getattr(config, "indexer_types", None) or []) if t != "full"]
        if shared:
            raise _refuse("indexer shared across layers", f"model_type={mt!r}, indexer_types[{shared}] != 'full'",
                          "serve a checkpoint whose every layer runs its own indexer (indexer_types all 'full'); "
                          "cross-layer top-k reuse is not routed")
        if getattr(config, "q_lora_rank", None) is None:
            raise _refuse("DSA indexer without q_lora", f"model_type={mt!r}, q_lora_rank=None",
                          "serve a checkpoint with q_lora_rank set (the indexer reads q_a_layernorm's output)")
    return SUPPORTED[mt]


def attention_spec(config: Any) -> AttentionSpec:
    """The `AttentionSpec` the DCP rules and passes need, from an HF config."""
    kind = check_supported(config)
    if kind in ("mla", "sfa"):
        return AttentionSpec(kind, config.num_attention_heads, has_indexer=kind == "sfa")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return AttentionSpec("gqa", config.num_attention_heads, kv)


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
