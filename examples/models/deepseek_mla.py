"""DeepSeek-V2/V3-style decoder with absorbed MLA (dense MLP only), plain PyTorch.

Matches HF `transformers` DeepseekV2ForCausalLM / DeepseekV3ForCausalLM when every
layer is dense (`first_k_dense_replace == num_hidden_layers`, no MoE).

Attention (per token, heads H sharded over TP; the latent is shared by all heads):

    q            = q_proj(x)                      or q_b_proj(q_a_layernorm(q_a_proj(x)))
    q_nope, q_pe = split(q, [nope, rope])         [T, H, nope], [T, H, R]
    kv_c, k_pe   = split(kv_a_proj_with_mqa(x), [L, R]);  kv_c = kv_a_layernorm(kv_c)
    q_pe, k_pe   = rope(q_pe), rope(k_pe)
    q_abs        = einsum(q_nope, W_UK)           [T, H, L]       (W_UK [H, nope, L])
    o_lat        = cp.mla_attention(q_abs, q_pe, kv_c, k_pe, cache)   [T, H, L]
    o            = einsum(o_lat, W_UV)            [T, H, v]       (W_UV [H, L, v])
    out          = o_proj(o)                      row-parallel + all-reduce

W_UK / W_UV are the two halves of HF's kv_b_proj ([H*(nope+v), L]). The score
q_nope . (W_UK c) + q_pe . k_pe equals HF's expanded form exactly (absorption);
the cache holds [c ; k_pe] ([L + R] per token), the same for every head and rank.

Rope: DeepSeek rotates interleaved pairs (2i, 2i+1) (`rope_interleave=True`, the
V3 default; V2 always does it, through complex multiplication). With
`rope_interleave=False` (V3 only) it is neox `rotate_half`.
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
    StateDictReader,
    apply_rope_interleaved,
    apply_rope_neox,
    load_norm,
    load_replicated,
    shard,
)
from examples.models.quant import W8A8ColumnLinear, row_parallel_o_proj


def _load_replicated_linear(lin: nn.Module, sd: StateDictReader, name: str) -> None:
    """A replicated projection: float nn.Linear (weight and bias as they are) or W8A8 (quantised)."""
    if isinstance(lin, W8A8ColumnLinear):
        lin.load_full(sd.take(f"{name}.weight"), sd.get(f"{name}.bias"), name=name)
        return
    load_replicated(lin.weight, sd.take(f"{name}.weight"), f"{name}.weight")
    if lin.bias is not None:
        load_replicated(lin.bias, sd.take(f"{name}.bias"), f"{name}.bias")


@dataclass
class DeepseekMLAConfig:
    vocab_size: int = 102400
    hidden_size: int = 2048
    num_layers: int = 27
    num_heads: int = 16
    q_lora_rank: int | None = None  # None: q_proj directly (V2-Lite)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    intermediate_size: int = 10944
    rms_norm_eps: float = 1e-6
    # HF builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps (1e-6),
    # not rms_norm_eps (as does DeepSeek's own reference code).
    latent_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    # o_proj as a W8A8 row-parallel linear (examples.models.quant.W8A8Config), quantised
    # from the checkpoint's float weight at load; None: the float RowParallelLinear.
    o_proj_quant: Any = None
    # The MLA projections (q_a / q_b or q_proj, kv_a_proj_with_mqa) as W8A8 dynamic
    # linears (examples.models.quant.W8A8ColumnLinear), quantised at load; any truthy
    # value turns them on (per-token dynamic activations is the only scheme built).
    mla_quant: Any = None

    def __post_init__(self) -> None:
        check_config_fields(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "kv_lora_rank",
                                   "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "intermediate_size")
                            + (("q_lora_rank",) if self.q_lora_rank is not None else ()),
                            even=("qk_rope_head_dim",))

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> "DeepseekMLAConfig":
        """From a `transformers.DeepseekV2Config` or `DeepseekV3Config` with dense layers only."""
        rope = getattr(hf, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", "default")
        if rope_type != "default":
            raise NotImplementedError(f"DeepSeek MLA example supports default rope only (no yarn), "
                                      f"got rope_type={rope_type!r}")
        # transformers 5.x decides MoE per layer from mlp_layer_types ("sparse" = MoE);
        # older configs only from first_k_dense_replace. Read both as transformers does.
        moe = [i for i, t in enumerate(getattr(hf, "mlp_layer_types", None) or []) if t != "dense"]
        if moe:
            raise NotImplementedError(f"DeepSeek MLA example has dense MLPs only, but mlp_layer_types marks layers "
                                      f"{moe} as MoE ({[hf.mlp_layer_types[i] for i in moe][:3]}...): MoE layers are "
                                      f"not built. Fix: a checkpoint with dense layers only "
                                      f"(mlp_layer_types all 'dense')")
        if hf.first_k_dense_replace < hf.num_hidden_layers:
            raise NotImplementedError(f"DeepSeek MLA example has dense MLPs only: set first_k_dense_replace="
                                      f"{hf.num_hidden_layers} (got {hf.first_k_dense_replace})")
        # V2 has no rope_interleave attribute and always rotates interleaved pairs.
        interleave = getattr(hf, "rope_interleave", None)
        if hf.model_type == "deepseek_v2" or interleave is None:
            interleave = True
        theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        return cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
                   num_heads=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
                   qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                   v_head_dim=hf.v_head_dim, intermediate_size=hf.intermediate_size,
                   rms_norm_eps=hf.rms_norm_eps, rope_theta=float(theta), rope_interleave=bool(interleave),
                   tie_word_embeddings=bool(hf.tie_word_embeddings),
                   attention_bias=bool(getattr(hf, "attention_bias", False)))


class MLAAttention(nn.Module):
    def __init__(self, cfg: DeepseekMLAConfig, tp_size: int, tp_rank: int,
                 tp_group: dist.ProcessGroup | None) -> None:
        super().__init__()
        if cfg.num_heads % tp_size != 0:
            raise ValueError(f"num_heads={cfg.num_heads} must be divisible by tp_size={tp_size}")
        self.cfg = cfg
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.num_heads = cfg.num_heads // tp_size  # local
        self.nope, self.rope, self.L, self.dv = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                 cfg.kv_lora_rank, cfg.v_head_dim)
        self.scale = cfg.qk_head_dim ** -0.5
        H, bias = cfg.num_heads, cfg.attention_bias
        col = ColumnParallelLinear if cfg.mla_quant is None else W8A8ColumnLinear
        if cfg.mla_quant is None:
            replicated = lambda i, o: nn.Linear(i, o, bias=bias)  # noqa: E731
        else:
            replicated = lambda i, o: W8A8ColumnLinear(i, o, bias=bias)  # noqa: E731
        if cfg.q_lora_rank is None:
            self.q_proj = col(cfg.hidden_size, H * cfg.qk_head_dim, tp_size, tp_rank)
        else:
            self.q_a_proj = replicated(cfg.hidden_size, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
            self.q_b_proj = col(cfg.q_lora_rank, H * cfg.qk_head_dim, tp_size, tp_rank)
        self.kv_a_proj_with_mqa = replicated(cfg.hidden_size, self.L + self.rope)
        self.kv_a_layernorm = RMSNorm(self.L, cfg.latent_norm_eps)
        # kv_b_proj split per (local) head into the absorbed matrices.
        self.w_uk = nn.Parameter(torch.empty(self.num_heads, self.nope, self.L))  # [H, nope, L]
        self.w_uv = nn.Parameter(torch.empty(self.num_heads, self.L, self.dv))  # [H, L, v]
        nn.init.normal_(self.w_uk, std=0.02)
        nn.init.normal_(self.w_uv, std=0.02)
        self.o_proj = row_parallel_o_proj(H * self.dv, cfg.hidden_size, tp_size, tp_rank, bias, tp_group,
                                          cfg.o_proj_quant)
        self.rope_fn = apply_rope_interleaved if cfg.rope_interleave else apply_rope_neox

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> (q_abs [T, H, L], q_pe [T, H, R], kv_c [T, L], k_pe [T, R], q_resid).

        q_resid [T, q_lora_rank] is q_a_layernorm(q_a_proj(x)) (None without q_lora);
        the sparse (SFA) subclass feeds it to its indexer.
        """
        T = x.shape[0]
        q_resid = None
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(T, self.num_heads, self.nope + self.rope)  # [T, H, nope + R]
        q_nope, q_pe = torch.split(q, [self.nope, self.rope], dim=-1)
        kv_c, k_pe = torch.split(self.kv_a_proj_with_mqa(x), [self.L, self.rope], dim=-1)  # [T, L], [T, R]
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe = self.rope_fn(q_pe, cos, sin)  # [T, H, R]
        k_pe = self.rope_fn(k_pe[:, None, :], cos, sin)[:, 0]  # [T, R]
        q_abs = torch.einsum("thn,hnl->thl", q_nope, self.w_uk)  # [T, H, L]
        return q_abs, q_pe.contiguous(), kv_c.contiguous(), k_pe.contiguous(), q_resid

    def output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Attention latent o_lat [T, H, L] -> o_proj(W_UV o_lat) [T, hidden] (TP all-reduce)."""
        o = torch.einsum("thl,hlv->thv", o_lat, self.w_uv)  # [T, H, v]
        return self.o_proj(o.reshape(o.shape[0], self.num_heads * self.dv))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: tuple[torch.Tensor, ...], meta: AttentionMetadata) -> torch.Tensor:
        q_abs, q_pe, kv_c, k_pe, _ = self.project(x, cos, sin)  # x [T, hidden]
        kv_cache_t, *scales = kv_cache  # [NB, BS, L + R]; quantised: + its scales [NB, BS, 1]
        meta_args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc, self.scale)
        if scales:
            o_lat = torch.ops.cp.mla_attention_quant(q_abs, q_pe, kv_c, k_pe, kv_cache_t, *scales, *meta_args)
        else:
            o_lat = torch.ops.cp.mla_attention(q_abs, q_pe, kv_c, k_pe, kv_cache_t, *meta_args)  # [T, H, L]
        return self.output(o_lat)  # [T, hidden]

    def load_hf(self, sd: StateDictReader, prefix: str) -> None:
        cfg = self.cfg
        if cfg.q_lora_rank is None:
            self.q_proj.load_full(sd.take(f"{prefix}.q_proj.weight"), name=f"{prefix}.q_proj")
        else:
            _load_replicated_linear(self.q_a_proj, sd, f"{prefix}.q_a_proj")
            load_norm(self.q_a_layernorm, sd, f"{prefix}.q_a_layernorm.weight")
            self.q_b_proj.load_full(sd.take(f"{prefix}.q_b_proj.weight"), name=f"{prefix}.q_b_proj")
        _load_replicated_linear(self.kv_a_proj_with_mqa, sd, f"{prefix}.kv_a_proj_with_mqa")
        load_norm(self.kv_a_layernorm, sd, f"{prefix}.kv_a_layernorm.weight")
        kv_b = sd.take(f"{prefix}.kv_b_proj.weight")  # [H * (nope + v), L]
        kv_b = kv_b.view(cfg.num_heads, self.nope + self.dv, self.L)
        kv_b = shard(kv_b, 0, self.tp_size, self.tp_rank)  # this rank's heads
        load_replicated(self.w_uk, kv_b[:, : self.nope, :], f"{prefix}.kv_b_proj.weight (W_UK)")
        load_replicated(self.w_uv, kv_b[:, self.nope:, :].transpose(1, 2), f"{prefix}.kv_b_proj.weight (W_UV)")
        self.o_proj.load_full(sd.take(f"{prefix}.o_proj.weight"), sd.get(f"{prefix}.o_proj.bias"),
                              name=f"{prefix}.o_proj")


class DeepseekMLAModel(CausalLM):
    """DeepSeek MLA causal LM on one TP rank. Embedding and lm_head are replicated."""

    attention_cls = MLAAttention  # the sparse (SFA) subclass swaps in its indexed attention

    def __init__(self, cfg, tp_size: int = 1, tp_rank: int = 0,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        attn = type(self).attention_cls
        super().__init__(cfg, tp_size, tp_rank, tp_group, lambda: attn(cfg, tp_size, tp_rank, tp_group),
                         rotary_dim=cfg.qk_rope_head_dim)

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(num_layers=self.cfg.num_layers, kind="mla", latent_dim=self.cfg.latent_dim)

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec("mla", self.cfg.num_heads)


load_hf_state_dict = common_load_hf_state_dict
