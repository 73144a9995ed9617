"""One instance's KV layout and model geometry, as the transfer planner sees them.

A prefill (P) and a decode (D) instance each shard a request's KV by the rule of
docs/architecture.md §5 over their own context-parallel ranks (N = pcp * dcp, cp rank =
pcp_rank * dcp + dcp_rank, world rank = pcp_rank * tp + tp_rank), with their own
interleave and block size, and (GQA) their own TP split of the KV heads
(`kv_cache.tp_kv_head_ids`). `KVLayout` is that layout as plain data (it crosses the
store between instances); `KVGeometry` is what both sides must agree on before any
byte moves (`check_compatible`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from cp_compile.base.config import AttentionSpec, CPConfig
from cp_compile.base.errors import ConfigError
from cp_compile.runtime.kv_cache import KVCacheSpec, tp_kv_head_ids

SCALE_BYTES = 4  # a quantised cache's scales are fp32 (decision 65)


@dataclass(frozen=True)
class RankCoords:
    rank: int  # world rank of the instance
    tp_rank: int
    pcp_rank: int
    dcp_rank: int
    cp_rank: int  # owner index of §5 at N = pcp * dcp


@dataclass(frozen=True)
class KVLayout:
    """The cache layout of one instance (the CPConfig fields the layout depends on)."""

    tensor_parallel_size: int
    prefill_context_parallel_size: int
    decode_context_parallel_size: int
    cp_kv_cache_interleave_size: int
    block_size: int  # tokens per physical page on one rank

    @classmethod
    def from_config(cls, cfg: CPConfig) -> "KVLayout":
        return cls(cfg.tensor_parallel_size, cfg.prefill_context_parallel_size, cfg.decode_context_parallel_size,
                   cfg.cp_kv_cache_interleave_size, cfg.block_size)

    @property
    def context_parallel_size(self) -> int:
        return self.prefill_context_parallel_size * self.decode_context_parallel_size

    @property
    def virtual_block_size(self) -> int:
        return self.block_size * self.context_parallel_size

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.prefill_context_parallel_size

    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside a world of {self.world_size} ranks ({self})")
        tp, dcp = self.tensor_parallel_size, self.decode_context_parallel_size
        pcp_rank, tp_rank = divmod(rank, tp)
        dcp_rank = tp_rank % dcp
        return RankCoords(rank, tp_rank, pcp_rank, dcp_rank, pcp_rank * dcp + dcp_rank)

    def describe(self) -> str:
        return (f"tp={self.tensor_parallel_size} pcp={self.prefill_context_parallel_size} "
                f"dcp={self.decode_context_parallel_size} interleave={self.cp_kv_cache_interleave_size} "
                f"block_size={self.block_size}")


def _itemsize(dtype: str) -> int:
    """Bytes of one element of a dtype named as `str(torch.dtype)` ("torch.int8")."""
    return getattr(torch, dtype.removeprefix("torch.")).itemsize


@dataclass(frozen=True)
class KVGeometry:
    """Per-token cache geometry of the model, the same on both instances (global heads)."""

    kind: str  # "gqa" | "mla" | "sfa"
    num_layers: int
    num_kv_heads: int = 0  # GQA: the model's KV heads (all of them, not per rank)
    head_dim: int = 0  # GQA K
    v_head_dim: int = 0  # GQA V
    latent_dim: int = 0  # MLA / SFA latent (kv_lora_rank + rope dim)
    index_dim: int = 0  # SFA indexer key dim (replicated cache)
    dtype: str = "torch.float32"  # the pages' dtype (a quantised cache: int8 / float8_e4m3fn)
    # CPConfig.kv_cache_dtype: "auto", or "int8" / "fp8_e4m3" (decision 65): the pages then hold
    # codes and each token carries an fp32 scale per KV head (MLA: one), which moves with it
    kv_cache_dtype: str = "auto"
    # SFA's replicated indexer cache dtype when it differs from the pages' ("": the same). A
    # quantised SFA cache keeps its indexer keys in the model's dtype (decision 69): int8 / fp8
    # latent codes beside fp32 / bf16 index rows, so the byte formulas count each with its own size.
    index_dtype: str = ""

    @classmethod
    def of(cls, spec: KVCacheSpec, attention: AttentionSpec, dtype: torch.dtype,
           kv_cache_dtype: str = "auto", index_dtype: torch.dtype | None = None) -> "KVGeometry":
        """`dtype`: the pages' dtype (`KVCache.layers[0][0].dtype`); `kv_cache_dtype`: the cache's
        `KVCache.kv_cache_dtype` (the config field); `index_dtype`: SFA's indexer cache dtype
        (`KVCache.replicated[0].dtype`), required for a quantised SFA cache."""
        if spec.kind == "sfa" and kv_cache_dtype != "auto" and index_dtype is None:
            raise ConfigError("a quantised SFA cache's transfer geometry names its indexer dtype",
                              f"cache kind='sfa', kv_cache_dtype={kv_cache_dtype!r}, index_dtype=None (the latent "
                              f"is {dtype}, the indexer keys stay in the model's dtype)",
                              "pass index_dtype=KVCache.replicated[0].dtype to KVGeometry.of")
        gqa = spec.kind == "gqa"
        idx = str(index_dtype) if spec.kind == "sfa" and index_dtype is not None and index_dtype != dtype else ""
        return cls(kind=spec.kind, num_layers=spec.num_layers, num_kv_heads=attention.num_kv_heads if gqa else 0,
                   head_dim=spec.head_dim if gqa else 0,
                   v_head_dim=(spec.v_head_dim or spec.head_dim) if gqa else 0,
                   latent_dim=0 if gqa else spec.latent_dim, index_dim=spec.index_dim if spec.kind == "sfa" else 0,
                   dtype=str(dtype), kv_cache_dtype=kv_cache_dtype, index_dtype=idx)

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def scale_bytes_per_head(self) -> int:
        """Bytes of scale one token carries per KV head and page tensor (GQA: K and V each;
        MLA: one for the latent row): 4 (fp32) for a quantised cache, else 0."""
        return SCALE_BYTES if self.quantized else 0

    @property
    def element_size(self) -> int:
        return _itemsize(self.dtype)

    @property
    def index_element_size(self) -> int:
        """Bytes of one SFA indexer key element (its own dtype, or the pages')."""
        return _itemsize(self.index_dtype or self.dtype)

    def kv_heads_of(self, layout: KVLayout, rank: int) -> tuple[int, ...]:
        """Global KV heads world rank `rank` of `layout` holds (GQA); () for latent caches."""
        if self.kind != "gqa":
            return ()
        return tp_kv_head_ids(self.num_kv_heads, layout.tensor_parallel_size, layout.coords(rank).tp_rank)


def check_compatible(prefill: KVGeometry, decode: KVGeometry) -> None:
    """Refuse a P -> D transfer whose caches do not hold the same thing: `ConfigError`
    naming every differing field (P value, D value). Called on every D rank with the
    same two descriptors, so every rank refuses alike, before any transfer is posted.
    A different `kv_cache_dtype` is refused first with its own fix (the codes of one
    quantisation are not values, nor codes, of the other; decision 67)."""
    if prefill.kv_cache_dtype != decode.kv_cache_dtype:
        raise ConfigError("prefill and decode instances store the KV cache in the same kv_cache_dtype (KV transfer)",
                          f"kv_cache_dtype: prefill {prefill.kv_cache_dtype!r}, decode {decode.kv_cache_dtype!r}",
                          f"start the decode instance with CPConfig(kv_cache_dtype={prefill.kv_cache_dtype!r}), "
                          f"the prefill instance's (or the prefill with the decode's "
                          f"{decode.kv_cache_dtype!r}): pages and scales are copied as bytes, never converted")
    diff = [(f.name, getattr(prefill, f.name), getattr(decode, f.name)) for f in fields(KVGeometry)
            if getattr(prefill, f.name) != getattr(decode, f.name)]
    if diff:
        shown = ", ".join(f"{name}: prefill {a!r}, decode {b!r}" for name, a, b in diff)
        raise ConfigError("prefill and decode instances serve the same model and cache dtype (KV transfer)",
                          shown, "start the decode instance with the prefill instance's model (layers, KV heads, "
                          "head / latent / indexer dims) and KV-cache dtype")

