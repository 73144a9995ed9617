"""Tiny random Hugging Face models (offline, no hub) and their example-model twins.

Shared by the parity tests, the compiled-model tests, the quick start and the
benchmark: the same HF weights load into the example models at any TP size.
Needs `transformers` (the `test` extra).
"""

from __future__ import annotations

import math

import torch
import transformers

from examples.models.deepseek_mla import DeepseekMLAConfig, DeepseekMLAModel
from examples.models.deepseek_sfa import DeepseekSFAConfig, DeepseekSFAModel
from examples.models.qwen3 import Qwen3Config, Qwen3Model

VOCAB = 128


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations (HF's std-0.02 init makes attention near-uniform and logits tiny)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:  # biases
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))


def hf_qwen3(tie: bool = False, bias: bool = False, num_kv_heads: int = 2, num_heads: int = 4,
             num_layers: int = 2, head_dim: int = 16):
    cfg = transformers.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=tie,
        attention_bias=bias, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    _randomize(model, 1)
    return model


# DeepSeek configs use a large rms_norm_eps on purpose: HF builds q_a_layernorm /
# kv_a_layernorm with the RMSNorm default eps 1e-6, not rms_norm_eps; with O(1)
# latents only a large eps makes that difference visible in the logits.


def hf_deepseek_v3(q_lora_rank: int | None = 24, rope_interleave: bool = True, num_heads: int = 4,
                   num_layers: int = 2, kv_lora_rank: int = 32, qk_rope_head_dim: int = 8):
    cfg = transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_layers, first_k_dense_replace=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=16,
        qk_rope_head_dim=qk_rope_head_dim, v_head_dim=12,
        rms_norm_eps=1e-2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=rope_interleave, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    _randomize(model, 2)
    return model


def hf_deepseek_v2_lite(q_lora_rank: int | None = None, attention_bias: bool = False, num_heads: int = 4):
    """Tiny DeepSeek-V2(-Lite: q_proj, no q-LoRA by default); its RoPE is HF's complex `freqs_cis` form."""
    cfg = transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=2, num_attention_heads=num_heads, num_key_value_heads=num_heads,
        q_lora_rank=q_lora_rank, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        rms_norm_eps=1e-2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=attention_bias, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    _randomize(model, 3)
    return model


def hf_deepseek_sfa(model_type: str = "deepseek_v32", num_heads: int = 4, num_layers: int = 2,
                    index_topk: int = 5):
    """Tiny DeepSeek-V3.2 (`deepseek_v32`) or GLM-5 (`glm_moe_dsa`) model: MLA + lightning
    indexer, dense layers only, `index_topk` below the test sequences' lengths (sparse).

    16 indexer heads: a key whose q . k is negative on every head scores exactly 0,
    and HF's `topk` breaks such ties arbitrarily (the op: lower position first). With
    2 heads a quarter of the keys tie at 0; with 16, about 2**-16 of them."""
    cls = {"deepseek_v32": (transformers.DeepseekV32Config, transformers.DeepseekV32ForCausalLM),
           "glm_moe_dsa": (transformers.GlmMoeDsaConfig, transformers.GlmMoeDsaForCausalLM)}[model_type]
    extra = {"indexer_types": ["full"] * num_layers} if model_type == "glm_moe_dsa" else {}
    cfg = cls[0](
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=num_layers, first_k_dense_replace=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, index_n_heads=16, index_head_dim=16, index_topk=index_topk, rms_norm_eps=1e-2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        attn_implementation="eager", **extra)
    torch.manual_seed(0)
    model = cls[1](cfg).eval()
    _randomize(model, 4)
    return model


def example_from_hf(hf_model, tp_size: int = 1, tp_rank: int = 0, tp_group=None,
                    state_dict: dict[str, torch.Tensor] | None = None):
    """The example model of `hf_model`'s architecture, holding this TP rank's shard of its weights."""
    return example_from_config(hf_model.config, state_dict if state_dict is not None else hf_model.state_dict(),
                               tp_size, tp_rank, tp_group)


def example_from_config(hf_config, state_dict: dict[str, torch.Tensor], tp_size: int = 1, tp_rank: int = 0,
                        tp_group=None):
    """Same from an HF config and HF-named state dict (e.g. shipped to spawned ranks)."""
    if hf_config.model_type == "qwen3":
        model = Qwen3Model(Qwen3Config.from_hf(hf_config), tp_size, tp_rank, tp_group)
    elif hf_config.model_type in ("deepseek_v32", "glm_moe_dsa"):
        model = DeepseekSFAModel(DeepseekSFAConfig.from_hf(hf_config), tp_size, tp_rank, tp_group)
    else:
        model = DeepseekMLAModel(DeepseekMLAConfig.from_hf(hf_config), tp_size, tp_rank, tp_group)
    model.load_hf_state_dict(state_dict)
    return model.eval()
