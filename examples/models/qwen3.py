"""Qwen3-style decoder (GQA) in plain PyTorch, tensor parallel written out plainly.

Matches HF `transformers` Qwen3ForCausalLM (dense; no sliding window): per-head
q_norm / k_norm RMSNorm before neox-style rope, SwiGLU MLP, optional tied
embeddings. Attention is `torch.ops.cp.gqa_paged_attention` over a paged KV cache;
the DCP compiler passes rewrite it, the model never mentions DCP.

Tokens are flattened across requests (vLLM style): `input_ids[T]`, `positions[T]`,
with `AttentionMetadata` describing requests, the block table and the slot mapping
(padding tokens have slot -1 and produce meaningless logits).

TP layout on rank r of tp: q heads [r*Hq/tp, (r+1)*Hq/tp); KV heads sharded as
`num_kv_heads / tp` per rank when tp <= num_kv_heads, else each KV head replicated on
tp // num_kv_heads consecutive ranks (rank r holds KV head r // (tp // num_kv_heads)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import cp_compile.ops  # noqa: F401  (registers torch.ops.cp.*)
from cp_compile.base.config import AttentionSpec
from cp_compile.runtime.kv_cache import KVCacheSpec
from cp_compile.runtime.metadata import AttentionMetadata

from examples.models.common import check_config_fields
from examples.models.common import load_hf_state_dict as common_load_hf_state_dict
from examples.models.common import (
    CausalLM,
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    StateDictReader,
    apply_rope_neox,
    load_norm,
)


@dataclass
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 4096
    num_layers: int = 36
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 12288
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def __post_init__(self) -> None:
        check_config_fields(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                                   "head_dim", "intermediate_size"), even=("head_dim",),
                            divides=(("num_heads", "num_kv_heads"),))

    @classmethod
    def from_hf(cls, hf: Any) -> "Qwen3Config":
        """From a `transformers.Qwen3Config` (default rope, no sliding window)."""
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise NotImplementedError(f"Qwen3 example supports default rope only, got rope_type={rope_type!r}")
        if getattr(hf, "use_sliding_window", False):
            raise NotImplementedError("Qwen3 example has no sliding-window attention")
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 1_000_000.0))
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
                   num_heads=hf.num_attention_heads, num_kv_heads=hf.num_key_value_heads,
                   head_dim=hf.head_dim, intermediate_size=hf.intermediate_size,
                   rms_norm_eps=hf.rms_norm_eps, rope_theta=float(theta),
                   tie_word_embeddings=bool(hf.tie_word_embeddings),
                   attention_bias=bool(getattr(hf, "attention_bias", False)))


def _kv_shards(num_kv_heads: int, tp_size: int) -> int:
    """Distinct KV-head shards: tp when tp <= kv heads, else kv heads (replicated)."""
    if tp_size <= num_kv_heads:
        if num_kv_heads % tp_size != 0:
            raise ValueError(f"num_kv_heads={num_kv_heads} must be divisible by tp_size={tp_size}")
        return tp_size
    if tp_size % num_kv_heads != 0:
        raise ValueError(f"tp_size={tp_size} must be a multiple of num_kv_heads={num_kv_heads}")
    return num_kv_heads


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: Qwen3Config, tp_size: int, tp_rank: int, tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        if cfg.num_heads % tp_size != 0:
            raise ValueError(f"num_heads={cfg.num_heads} must be divisible by tp_size={tp_size}")
        kv_shards = _kv_shards(cfg.num_kv_heads, tp_size)
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_heads // tp_size  # local
        self.num_kv_heads = cfg.num_kv_heads // kv_shards  # local
        self.scale = cfg.head_dim ** -0.5
        D, bias = cfg.head_dim, cfg.attention_bias
        self.q_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_heads * D, tp_size, tp_rank, bias)
        self.k_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * D, tp_size, tp_rank, bias,
                                           num_shards=kv_shards)
        self.v_proj = ColumnParallelLinear(cfg.hidden_size, cfg.num_kv_heads * D, tp_size, tp_rank, bias,
                                           num_shards=kv_shards)
        self.o_proj = RowParallelLinear(cfg.num_heads * D, cfg.hidden_size, tp_size, tp_rank, bias, tp_group)
        self.q_norm = RMSNorm(D, cfg.rms_norm_eps)  # per head, replicated
        self.k_norm = RMSNorm(D, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        T = x.shape[0]  # x [T, hidden]
        q = self.q_norm(self.q_proj(x).view(T, self.num_heads, self.head_dim))  # [T, Hq, D]
        k = self.k_norm(self.k_proj(x).view(T, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        q = apply_rope_neox(q, cos, sin)
        k = apply_rope_neox(k, cos, sin)
        # [NB, BS, Hkv, D] each; a quantised cache (kv_cache_dtype int8 / fp8) adds its two
        # scale caches [NB, BS, Hkv], which the op writes and reads beside the pages.
        k_cache, v_cache, *scales = kv_cache
        meta_args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc, self.scale)
        if scales:
            o = torch.ops.cp.gqa_paged_attention_quant(q, k, v, k_cache, v_cache, *scales, *meta_args)
        else:
            o = torch.ops.cp.gqa_paged_attention(q, k, v, k_cache, v_cache, *meta_args)  # [T, Hq, D]
        return self.o_proj(o.reshape(T, self.num_heads * self.head_dim))  # [T, hidden]

    def load_hf(self, sd: StateDictReader, prefix: str) -> None:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(self, name).load_full(sd.take(f"{prefix}.{name}.weight"), sd.get(f"{prefix}.{name}.bias"),
                                          name=f"{prefix}.{name}")
        load_norm(self.q_norm, sd, f"{prefix}.q_norm.weight")
        load_norm(self.k_norm, sd, f"{prefix}.k_norm.weight")


class Qwen3Model(CausalLM):
    """Qwen3 causal LM on one TP rank. Embedding and lm_head are replicated."""

    def __init__(self, cfg, tp_size: int = 1, tp_rank: int = 0,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__(cfg, tp_size, tp_rank, tp_group, lambda: Qwen3Attention(cfg, tp_size, tp_rank, tp_group),
                         rotary_dim=cfg.head_dim)

    # -- what the runtime / config validation need
    def kv_cache_spec(self) -> KVCacheSpec:
        attn = self.layers[0].self_attn
        first = attn.k_proj.shard_index * attn.num_kv_heads  # global id of this rank's first KV head
        return KVCacheSpec(num_layers=self.cfg.num_layers, kind="gqa", head_dim=self.cfg.head_dim,
                           v_head_dim=self.cfg.head_dim, num_kv_heads_per_rank=attn.num_kv_heads,
                           kv_head_ids=tuple(range(first, first + attn.num_kv_heads)))

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec("gqa", self.cfg.num_heads, self.cfg.num_kv_heads)


load_hf_state_dict = common_load_hf_state_dict
