"""DeepSeek-V3 multi-token prediction (MTP) layer, plain PyTorch with TP, and the
target wrapper that hands it the target's hidden states.

The MTP layer (DeepSeek-V3 report §2.2; vLLM `DeepSeekMultiTokenPredictorLayer`):

    e   = enorm(embed_tokens(token p + 1))           [T, hidden]
    h   = hnorm(target hidden at p)                   [T, hidden]  (final-normed, lm_head's input)
    x   = eh_proj([e ; h])                            [T, hidden]
    x   = decoder layer(x)                            the target's attention kind (MLA, SFA) + MLP,
                                                      its own one-layer KV cache at positions p
    out = shared_head.head(shared_head.norm(x))       logits of token p + 2; x feeds the next MTP step

In a DeepSeek-V3 checkpoint the layer is stored after the decoder layers, as
`model.layers.{num_hidden_layers}.{embed_tokens, enorm, hnorm, eh_proj, shared_head.norm,
shared_head.head, self_attn.*, mlp.*, input_layernorm, post_attention_layernorm}`
(transformers' DeepseekV3ForCausalLM ignores those keys); `load_mtp` reads them when
present. Otherwise the layer is tiny random (`DeepseekMTP.randomize`), with the
embedding and head shared with the target as in DeepSeek-V3. Its cache is allocated
like the target's (`kv_cache_spec()`: one layer), so under DCP / PCP it is sharded
over the same ranks and indexed by the same block tables.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cp_compile.base.config import AttentionSpec
from cp_compile.runtime.kv_cache import KVCacheSpec
from cp_compile.runtime.metadata import AttentionMetadata
from cp_compile.runtime.metadata_checks import validate_step

from examples.models.common import (
    CausalLM,
    DecoderLayer,
    RMSNorm,
    RotaryEmbedding,
    StateDictReader,
    load_norm,
    load_replicated,
)
from examples.models.deepseek_mla import DeepseekMLAConfig, DeepseekMLAModel


class _SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = nn.Linear(hidden, vocab, bias=False)


class DeepseekMTP(nn.Module):
    """One MTP layer of a DeepSeek MLA / SFA target, on one TP rank."""

    def __init__(self, cfg: DeepseekMLAConfig, attention_cls: type[nn.Module], tp_size: int = 1, tp_rank: int = 0,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.cfg = cfg
        self.attention_kind = "sfa" if getattr(cfg, "index_topk", None) else "mla"
        self.embed_tokens = nn.Embedding(cfg.vocab_size, H)
        self.enorm = RMSNorm(H, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)  # replicated
        self.rotary = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta)
        self.layer = DecoderLayer(attention_cls(cfg, tp_size, tp_rank, tp_group), H, cfg.intermediate_size,
                                  cfg.rms_norm_eps, tp_size, tp_rank, tp_group)
        self.shared_head = _SharedHead(H, cfg.vocab_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, ...]], meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (token p + 1), positions [T] (p), hidden [T, hidden] (at p) ->
        (logits [T, vocab] fp32 of token p + 2, hidden [T, hidden] for the next MTP step)."""
        if not torch.compiler.is_compiling():
            validate_step(meta, kv_caches, num_tokens=input_ids.shape[0])
        e = self.enorm(self.embed_tokens(input_ids))  # [T, hidden]
        x = self.eh_proj(torch.cat([e, self.hnorm(hidden)], dim=-1))  # [T, hidden]
        cos, sin = self.rotary(positions)
        x = self.layer(x, cos, sin, kv_caches[0], meta)
        return F.linear(self.shared_head.norm(x), self.shared_head.head.weight).float(), x

    def kv_cache_spec(self) -> KVCacheSpec:
        extra = {"index_dim": self.cfg.index_head_dim} if self.attention_kind == "sfa" else {}  # type: ignore[attr-defined]
        return KVCacheSpec(num_layers=1, kind=self.attention_kind, latent_dim=self.cfg.latent_dim, **extra)

    def attention_spec(self) -> AttentionSpec:
        return AttentionSpec(self.attention_kind, self.cfg.num_heads, has_indexer=self.attention_kind == "sfa")

    def randomize(self, target: CausalLM, seed: int) -> None:
        """Tiny random weights (O(1) activations), embedding and head shared with the target."""
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight") or name.startswith(("enorm", "hnorm")):
                    p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
                elif p.dim() == 1:
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
                else:
                    p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
            self.embed_tokens.weight.copy_(target.embed_tokens.weight)
            head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
            self.shared_head.head.weight.copy_(head)

    def load_hf(self, sd: StateDictReader, prefix: str) -> None:
        """The MTP layer's tensors under `prefix` (model.layers.{num_hidden_layers})."""
        load_replicated(self.embed_tokens.weight, sd.take(f"{prefix}.embed_tokens.weight"), f"{prefix}.embed_tokens")
        load_norm(self.enorm, sd, f"{prefix}.enorm.weight")
        load_norm(self.hnorm, sd, f"{prefix}.hnorm.weight")
        load_replicated(self.eh_proj.weight, sd.take(f"{prefix}.eh_proj.weight"), f"{prefix}.eh_proj.weight")
        load_norm(self.shared_head.norm, sd, f"{prefix}.shared_head.norm.weight")
        load_replicated(self.shared_head.head.weight, sd.take(f"{prefix}.shared_head.head.weight"),
                        f"{prefix}.shared_head.head.weight")
        self.layer.load_hf(sd, prefix)


def has_mtp(state_dict: Mapping[str, torch.Tensor], num_layers: int) -> bool:
    return f"model.layers.{num_layers}.eh_proj.weight" in state_dict


def build_mtp(target: DeepseekMLAModel, state_dict: Mapping[str, torch.Tensor] | None = None, seed: int = 5,
              tp_group: dist.ProcessGroup | None = None) -> DeepseekMTP:
    """The target's MTP layer: from the checkpoint's `model.layers.{num_layers}.*` when
    present (strict: every tensor under that prefix used), else tiny random weights."""
    cfg = target.cfg
    mtp = DeepseekMTP(cfg, type(target).attention_cls, target.tp_size, target.tp_rank, tp_group)
    if state_dict is not None and has_mtp(state_dict, cfg.num_layers):
        prefix = f"model.layers.{cfg.num_layers}"
        sd = StateDictReader({k: v for k, v in state_dict.items() if k.startswith(prefix + ".")})
        mtp.load_hf(sd, prefix)
        sd.check_all_used()
    else:
        mtp.randomize(target, seed)
    return mtp.eval()


def random_mtp_tensors(target: DeepseekMLAModel, seed: int = 7) -> dict[str, torch.Tensor]:
    """A checkpoint's MTP tensors, HF-named (`model.layers.{num_layers}.*`), for a tiny
    target built at tp 1: what a DeepSeek-V3 checkpoint adds to the causal LM's."""
    ref = build_mtp(target, seed=seed)
    prefix = f"model.layers.{target.cfg.num_layers}"
    out = {f"{prefix}.{k}": v.detach().clone() for k, v in ref.state_dict().items()
           if not k.startswith(("layer.", "rotary."))}
    # The decoder layer in HF names: absorbed W_UK / W_UV back into kv_b_proj [H * (nope + v), L].
    attn = ref.layer.self_attn
    kv_b = torch.cat([attn.w_uk, attn.w_uv.transpose(1, 2)], dim=1).reshape(-1, attn.L)
    for k, v in ref.layer.state_dict().items():
        if k.startswith("self_attn.w_u"):
            continue
        out[f"{prefix}.{k}"] = v.detach().clone()
    out[f"{prefix}.self_attn.kv_b_proj.weight"] = kv_b.detach().clone()
    return out


class WithHidden(nn.Module):
    """The target as an MTP proposer needs it: forward returns (logits, final-normed hidden)."""

    def __init__(self, model: CausalLM) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, ...]],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.model.hidden_states(input_ids, positions, kv_caches, meta)  # [T, hidden]
        return self.model.logits(h), h

    def attention_spec(self) -> AttentionSpec:
        return self.model.attention_spec()

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.model.kv_cache_spec()
