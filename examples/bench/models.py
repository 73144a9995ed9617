"""The benchmark model: built on each rank, its attention dims and bytes moved per step."""

from __future__ import annotations

from typing import Any

import torch

from cp_compile.base.comm_stats import decode_comm_bytes_per_layer


def build_hf_model(kind: str, tp: int) -> Any:
    """The tiny HF model with enough query heads for `tp` (2 per rank, at least 4).

    Qwen3 keeps a single KV head so that any dcp dividing tp is valid for GQA
    (DCP ranks must share KV heads: dcp | tp // num_kv_heads).
    """
    from examples.models.tiny import hf_deepseek_v3, hf_qwen3

    from examples.models.tiny import hf_deepseek_sfa

    heads = max(4, 2 * tp)
    if kind == "qwen3":
        return hf_qwen3(num_kv_heads=1, num_heads=heads)
    if kind == "sfa":
        return hf_deepseek_sfa(num_heads=heads)
    return hf_deepseek_v3(q_lora_rank=None, num_heads=heads)


def hf_state_dict(hf: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def attention_dims(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(query heads per rank, q dim on the wire, v dim on the wire, hidden size).

    GQA gathers q [T, H, D] and merges out [T, H, D]; absorbed MLA gathers q_nope
    [T, H, L] and q_pe [T, H, R] and merges latent outputs [T, H, L].
    """
    cfg = model.cfg
    heads = cfg.num_heads // model.tp_size
    if hasattr(cfg, "kv_lora_rank"):
        return heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.hidden_size
    return heads, cfg.head_dim, cfg.head_dim, cfg.hidden_size


def comm_bytes_per_step(model: torch.nn.Module, batch: int, tp: int, dcp: int, merge: str,
                        dtype: torch.dtype) -> tuple[int, int]:
    """Bytes one rank sends per decode step: (DCP attention traffic, TP all-reduce traffic).

    The TP all-reduces (o_proj and MLP down projection, two per layer, ring
    algorithm as `CollectiveMeter` counts them) are the same at every dcp.
    """
    heads, q_dim, v_dim, hidden = attention_dims(model)
    nbytes = torch.empty(0, dtype=dtype).element_size()
    layers = model.cfg.num_layers
    dcp_bytes = decode_comm_bytes_per_layer(batch, heads, q_dim, v_dim, nbytes, dcp, merge) * layers
    tp_bytes = 2 * layers * (2 * batch * hidden * nbytes * (tp - 1) // tp)
    return dcp_bytes, tp_bytes
