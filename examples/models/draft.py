"""Draft models for speculative decoding of the GQA (Qwen3-style) example model.

Two drafts, both ordinary `Qwen3Model`s with the target's vocabulary, KV-head count
(so the DCP rule `dcp | tp // num_kv_heads` holds for the draft as for the target)
and its own one-layer KV cache, allocated and sharded like the target's:

- `tiny_draft_hf`: a separate tiny random model (hidden 32, one layer): a small
  draft as a deployment would train one; with random weights it agrees with the
  target rarely, so it exercises rejection on nearly every step;
- `layer_skip_draft`: the target's first layer(s) with its final norm and head
  (self-speculation, as LayerSkip / Draft & Verify): no extra weights, and with the
  same embedding and head it agrees with the target far more often.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import torch
import transformers

from examples.models.qwen3 import Qwen3Config, Qwen3Model
from examples.models.tiny import _randomize


def tiny_draft_hf(target_hf_config: Any, hidden: int = 32, seed: int = 11) -> Any:
    """A one-layer tiny random HF Qwen3 with the target's vocabulary and KV heads."""
    t = target_hf_config
    cfg = transformers.Qwen3Config(
        vocab_size=t.vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1,
        num_attention_heads=t.num_attention_heads, num_key_value_heads=t.num_key_value_heads, head_dim=8,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    _randomize(model, seed)
    return model


def layer_skip_draft(target_cfg: Qwen3Config, target_state_dict: Mapping[str, torch.Tensor], tp_size: int = 1,
                     tp_rank: int = 0, tp_group: Any = None, num_layers: int = 1) -> Qwen3Model:
    """The target's first `num_layers` layers, final norm and head, as a draft model."""
    if not 1 <= num_layers < target_cfg.num_layers:
        raise ValueError(f"num_layers={num_layers} must be in [1, {target_cfg.num_layers}) (fewer than the target's)")
    keep = tuple(f"model.layers.{i}." for i in range(num_layers))
    sd = {k: v for k, v in target_state_dict.items() if not k.startswith("model.layers.") or k.startswith(keep)}
    model = Qwen3Model(replace(target_cfg, num_layers=num_layers), tp_size, tp_rank, tp_group)
    model.load_hf_state_dict(sd)
    return model.eval()
