"""DeepSeek-V3.2 / GLM-5 (`glm_moe_dsa`) style decoder: absorbed MLA with DeepSeek
Sparse Attention (a lightning indexer picks each query's top-k keys), dense MLP
only, plain PyTorch with TP.

Matches HF `transformers` DeepseekV32ForCausalLM and GlmMoeDsaForCausalLM when
every layer is dense (`first_k_dense_replace == num_hidden_layers`) and, for
GLM, every layer runs its own indexer (`indexer_types` all "full").

The MLA part is `deepseek_mla.MLAAttention` (same projections, absorption, cache);
each layer adds an indexer (replicated on every TP rank: every rank needs the same
top-k):

    q_I  = wq_b(q_resid)                         [T, Hi, Di]   (q_resid = q_a_layernorm(q_a_proj(x)))
    k_I  = LayerNorm(wk(x))                      [T, Di]
    rope on the first R dims of q_I and k_I      (V3.2: neox halves; GLM-5: interleaved pairs)
    w    = weights_proj(x) * Hi^-0.5 * Di^-0.5   [T, Hi]
    topk = cp.lightning_indexer(q_I, k_I, w, index_cache)  [T, K] int32 request-local positions
    o_lat = cp.sparse_mla_attention(q_abs, q_pe, kv_c, k_pe, cache, topk)

HF scores `sum_j w_j * Hi^-0.5 * relu(Di^-0.5 * q_j . k)`; since relu(c s) = c relu(s)
for c > 0 both scales fold into w, which is the form the op takes. HF picks
`topk(min(index_topk, T))` over causally masked scores (masked keys get the float
mask's minimum and stay masked in the attention), so its selected keys are the
top-k of the causal ones, which is what the op returns (-1 padded). HF's `topk`
has no tie rule and the op breaks ties to the lower position; with random
weights there are no exact ties.

Caches: `forward(input_ids, positions, kv_caches, meta)` takes per layer the tuple
`(latent_cache, index_cache)`, or `(latent_cache, latent_scale, index_cache)` for a quantised
latent (issue 39): `KVCache.layers[i]` (the latent, sharded 1/dcp under
DCP) followed by `KVCache.replicated[i]` (the indexer's keys, every token on every
rank in pages of block_size * dcp). `examples.serving.layer_caches(cache)` builds it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import cp_compile.ops  # noqa: F401  (registers torch.ops.cp.*)
from cp_compile.base.config import AttentionSpec
from cp_compile.runtime.kv_cache import KVCacheSpec
from cp_compile.runtime.metadata import AttentionMetadata

from examples.models.common import (StateDictReader, apply_rope_interleaved, apply_rope_neox, check_config_fields,
                                    load_replicated)
from examples.models.deepseek_mla import DeepseekMLAConfig, DeepseekMLAModel, MLAAttention


@dataclass
class DeepseekSFAConfig(DeepseekMLAConfig):
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    # The indexer's own rope layout: DeepSeek-V3.2 rotates halves (neox), GLM-5
    # interleaved pairs; the main MLA rope is interleaved in both.
    indexer_rope_interleave: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_config_fields(self, ("index_n_heads", "index_head_dim", "index_topk"))

    @classmethod
    def from_hf(cls, hf: Any) -> "DeepseekSFAConfig":
        """From a `transformers.DeepseekV32Config` or `GlmMoeDsaConfig` (dense layers only)."""
        if hf.model_type not in ("deepseek_v32", "glm_moe_dsa"):
            raise ValueError(f"DeepSeek SFA example: model_type {hf.model_type!r} is not deepseek_v32 / glm_moe_dsa")
        shared = [i for i, t in enumerate(getattr(hf, "indexer_types", None) or []) if t != "full"]
        if shared:
            # Shared layers reuse the previous layer's top-k; the example's layers do
            # not pass state to each other.
            raise NotImplementedError(f"DeepSeek SFA example runs an indexer in every layer; layers {shared} "
                                      f"share the previous layer's top-k (indexer_types={hf.indexer_types})")
        if hf.q_lora_rank is None:
            raise NotImplementedError("DeepSeek SFA example needs q_lora_rank (the indexer reads q_resid)")
        base = DeepseekMLAConfig.from_hf(hf)
        return cls(**asdict(base), index_n_heads=hf.index_n_heads, index_head_dim=hf.index_head_dim,
                   index_topk=hf.index_topk, indexer_rope_interleave=hf.model_type == "glm_moe_dsa")


class LightningIndexer(nn.Module):
    """Per-layer DSA indexer, replicated on every TP rank -> top-k positions [T, K] int32."""

    def __init__(self, cfg: DeepseekSFAConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
        self.topk = cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)  # HF: plain LayerNorm, fixed eps
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        for lin in (self.wq_b, self.wk, self.weights_proj):
            nn.init.normal_(lin.weight, std=0.02)
        # HF's n_heads^-0.5 on the weights and softmax_scale on the scores, folded into w.
        self.w_scale = self.n_heads ** -0.5 * self.head_dim ** -0.5
        self.rope_fn = apply_rope_interleaved if cfg.indexer_rope_interleave else apply_rope_neox

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                index_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        T, R = x.shape[0], self.rope  # x [T, hidden], q_resid [T, q_lora_rank]
        q = self.wq_b(q_resid).view(T, self.n_heads, self.head_dim)  # [T, Hi, Di]
        k = self.k_norm(self.wk(x))[:, None, :]  # [T, 1, Di]
        # Rope on the first R dims only (both layouts rotate q and k alike, so q . k is HF's).
        q = torch.cat([self.rope_fn(q[..., :R], cos, sin), q[..., R:]], dim=-1)  # [T, Hi, Di]
        k = torch.cat([self.rope_fn(k[..., :R], cos, sin), k[..., R:]], dim=-1)[:, 0]  # [T, Di]
        # In the model dtype (HF keeps weights_proj in fp32: a bf16 model rounds w once more
        # than HF's); the op scores in fp32 either way.
        w = self.weights_proj(x) * self.w_scale  # [T, Hi]
        return torch.ops.cp.lightning_indexer(
            q.contiguous(), k.contiguous(), w.contiguous(), index_cache, meta.slot_mapping, meta.block_table,
            meta.seq_lens, meta.query_start_loc, self.topk)  # [T, K] int32, -1 padded

    def load_hf(self, sd: StateDictReader, prefix: str) -> None:
        for name in ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"):
            mod, attr = name.split(".")
            load_replicated(getattr(getattr(self, mod), attr), sd.take(f"{prefix}.{name}"), f"{prefix}.{name}")


class SFAAttention(MLAAttention):
    """MLA attention over the indexer's top-k keys (DeepSeek Sparse Attention)."""

    def __init__(self, cfg: DeepseekSFAConfig, tp_size: int, tp_rank: int,
                 tp_group: dist.ProcessGroup | None) -> None:
        if cfg.q_lora_rank is None:
            raise ValueError("SFAAttention needs q_lora_rank: the indexer reads q_resid")
        super().__init__(cfg, tp_size, tp_rank, tp_group)
        self.indexer = LightningIndexer(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        # [NB, BS, L + R] (quantised: + its scales [NB, BS, 1]), [NB, BS * dcp, Di] in the model dtype
        latent_cache, *scales, index_cache = kv_cache
        q_abs, q_pe, kv_c, k_pe, q_resid = self.project(x, cos, sin)
        topk = self.indexer(x, q_resid, cos, sin, index_cache, meta)  # [T, K]
        meta_args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc, topk, self.scale)
        if scales:  # a quantised latent (CPConfig.kv_cache_dtype): its own op, the scale cache required
            o_lat = torch.ops.cp.sparse_mla_attention_quant(q_abs, q_pe, kv_c, k_pe, latent_cache, *scales,
                                                            *meta_args)  # [T, H, L]
        else:
            o_lat = torch.ops.cp.sparse_mla_attention(q_abs, q_pe, kv_c, k_pe, latent_cache, *meta_args)  # [T, H, L]
        return self.output(o_lat)  # [T, hidden]

    def load_hf(self, sd: StateDictReader, prefix: str) -> None:
        super().load_hf(sd, prefix)
        self.indexer.load_hf(sd, f"{prefix}.indexer")


class DeepseekSFAModel(DeepseekMLAModel):
    """DeepSeek-V3.2 / GLM-5 style causal LM on one TP rank (dense MLP only)."""

    attention_cls = SFAAttention

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_layers=self.cfg.num_layers, kind="sfa", latent_dim=self.cfg.latent_dim,
                           index_dim=self.cfg.index_head_dim)

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec("sfa", self.cfg.num_heads, has_indexer=True)
