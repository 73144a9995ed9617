"""Allocation of this rank's KV-cache shard (DESIGN.md §4, §5).

With DCP every rank holds `block_size` tokens of each virtual block of
`block_size * dcp`: for the same number of blocks (the same token capacity) the
per-rank cache is exactly 1/dcp of the dcp = 1 allocation. The lightning-indexer
cache is the exception: it is replicated (full virtual blocks) so top-k selection
sees the whole sequence (DESIGN.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cp_compile.config import AttentionSpec, CPConfig


@dataclass
class KVCacheSpec:
    """Per-layer cache geometry of a model on one TP rank."""

    num_layers: int
    kind: str  # "gqa" | "mla" | "sfa"
    head_dim: int = 0  # GQA: K head dim
    v_head_dim: int = 0  # GQA: V head dim
    num_kv_heads_per_rank: int = 0  # GQA
    latent_dim: int = 0  # MLA: kv_lora_rank + rope dim
    index_dim: int = 0  # SFA indexer key dim


@dataclass
class KVCache:
    """This rank's caches; `layers[i]` is a tuple of tensors of layer i."""

    layers: list[tuple[torch.Tensor, ...]]
    block_size: int  # physical tokens per page on this rank
    num_blocks: int
    replicated: list[torch.Tensor] = field(default_factory=list)  # indexer caches (not sharded)

    @property
    def sharded_bytes(self) -> int:
        """Bytes of the DCP-sharded caches (K/V or latent) on this rank."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    @property
    def replicated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.replicated)

    @property
    def tokens_per_rank(self) -> int:
        return self.num_blocks * self.block_size


def allocate_kv_cache(cfg: CPConfig, spec: KVCacheSpec, num_blocks: int,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                      attention: AttentionSpec | None = None) -> KVCache:
    """Allocate this rank's shard: `num_blocks` pages of `cfg.block_size` tokens per layer.

    The token capacity of the whole DCP group is `num_blocks * block_size * dcp`.
    Pass `attention` to validate the config against the model first.
    """
    if attention is not None:
        cfg.validate_for(attention)
    if num_blocks < 1:
        raise ValueError(f"num_blocks={num_blocks} must be >= 1")
    bs = cfg.block_size
    layers: list[tuple[torch.Tensor, ...]] = []
    replicated: list[torch.Tensor] = []
    for _ in range(spec.num_layers):
        if spec.kind == "gqa":
            if spec.num_kv_heads_per_rank < 1 or spec.head_dim < 1:
                raise ValueError("GQA cache needs num_kv_heads_per_rank >= 1 and head_dim >= 1")
            k = torch.zeros(num_blocks, bs, spec.num_kv_heads_per_rank, spec.head_dim, dtype=dtype, device=device)
            v = torch.zeros(num_blocks, bs, spec.num_kv_heads_per_rank, spec.v_head_dim or spec.head_dim,
                            dtype=dtype, device=device)
            layers.append((k, v))
        elif spec.kind in ("mla", "sfa"):
            if spec.latent_dim < 1:
                raise ValueError("MLA cache needs latent_dim >= 1 (kv_lora_rank + rope dim)")
            layers.append((torch.zeros(num_blocks, bs, spec.latent_dim, dtype=dtype, device=device),))
            if spec.kind == "sfa":
                # Replicated: full virtual blocks of block_size * dcp tokens on every rank.
                replicated.append(torch.zeros(num_blocks, bs * cfg.dcp, spec.index_dim, dtype=dtype, device=device))
        else:
            raise ValueError(f"unknown cache kind {spec.kind!r}; use 'gqa', 'mla' or 'sfa'")
    return KVCache(layers=layers, block_size=bs, num_blocks=num_blocks, replicated=replicated)
