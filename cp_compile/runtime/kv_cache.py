"""Allocation of this rank's KV-cache shard (docs/architecture.md §4, §5).

With DCP every rank holds `block_size` tokens of each virtual block of
`block_size * dcp`: for the same number of blocks (the same token capacity) the
per-rank cache is exactly 1/dcp of the dcp = 1 allocation. With PCP the cache is
sharded over all pcp * dcp ranks that share a KV head (the context-parallel group,
docs/pcp.md §2): virtual blocks of `block_size * pcp * dcp` tokens
(`CPConfig.virtual_block_size`), 1/(pcp*dcp) per rank. The lightning-indexer
cache is the exception: it is replicated (full virtual blocks) so top-k selection
sees the whole sequence (docs/architecture.md §6).

A quantised cache (`CPConfig.kv_cache_dtype` "int8" / "fp8_e4m3", issue 39, decision 65)
stores its pages in that dtype and adds one fp32 scale tensor per page tensor,
`[pages, block_size, kv_heads]` (MLA: kv_heads = 1), allocated and sharded exactly as
the pages: a layer is `(k, v, k_scale, v_scale)` (GQA) or `(kv, kv_scale)` (MLA), the
order the models pass them to the attention ops. The byte counts include the scales.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cp_compile.base.config import KV_CACHE_DTYPES, AttentionSpec, ConfigError, CPConfig
from cp_compile.ops.core.scratch_block import mark_scratch_block
from cp_compile.ops.core.sharded_cache import mark_sharded
from cp_compile.runtime.parallel_state import ParallelState, parallel_state_or_none


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
    # GQA: global ids of the KV heads this TP rank holds. The ranks of a DCP group
    # shard one head's tokens, so they must hold the same heads; equal shapes alone
    # do not show that (tp = 2, 2 KV heads: one different head per rank).
    kv_head_ids: tuple[int, ...] = ()


@dataclass
class KVCache:
    """This rank's caches; `layers[i]` is a tuple of tensors of layer i."""

    layers: list[tuple[torch.Tensor, ...]]
    block_size: int  # physical tokens per page on this rank
    num_blocks: int
    replicated: list[torch.Tensor] = field(default_factory=list)  # indexer caches (not sharded)
    kv_cache_dtype: str = "auto"  # CPConfig.kv_cache_dtype: "auto" or the quantised pages' dtype

    @property
    def quantized(self) -> bool:
        return self.kv_cache_dtype != "auto"

    @property
    def sharded_bytes(self) -> int:
        """Bytes of the DCP-sharded caches (K/V or latent, and a quantised cache's scales) on this rank."""
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    @property
    def scale_bytes(self) -> int:
        """The part of `sharded_bytes` that is quantisation scales (0 for "auto")."""
        if not self.quantized:
            return 0
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer[len(layer) // 2:])

    @property
    def replicated_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.replicated)

    @property
    def tokens_per_rank(self) -> int:
        return self.num_blocks * self.block_size


def tp_kv_head_ids(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, ...]:
    """KV heads TP rank `tp_rank` holds under Megatron-style sharding: a contiguous
    1/tp of them when tp <= num_kv_heads, else head tp_rank // (tp // num_kv_heads)."""
    if tp_size <= num_kv_heads:
        per = num_kv_heads // tp_size
        return tuple(range(tp_rank * per, (tp_rank + 1) * per))
    return (tp_rank // max(tp_size // num_kv_heads, 1),)


def _layout(cfg: CPConfig, spec: KVCacheSpec, num_blocks: int, dtype: torch.dtype) -> dict[str, Any]:
    return dict(asdict(spec), num_blocks=num_blocks, block_size=cfg.block_size, dtype=str(dtype),
                interleave=cfg.cp_kv_cache_interleave_size, kv_cache_dtype=cfg.kv_cache_dtype)


def check_dcp_layout(cfg: CPConfig, spec: KVCacheSpec, num_blocks: int, dtype: torch.dtype, *,
                     parallel: ParallelState | None) -> None:
    """One all-gather over this rank's context-parallel group (`parallel.cp_group`: the
    DCP group at pcp = 1, the pcp * dcp ranks sharing its KV heads under PCP): every
    rank must hold the same cache layout (kind, KV heads or latent dims, pages, dtype).
    A mismatch raises `ConfigError` on every rank of the group (they all see all
    layouts), before any step could merge partials of different heads. No-op when
    pcp * dcp == 1 or without a parallel state (`allocate_kv_cache` passes its own)."""
    n = cfg.context_parallel_size
    if parallel is None or n == 1:
        return
    mine = _layout(cfg, spec, num_blocks, dtype)
    layouts: list[Any] = [None] * n
    group = parallel.cp_group
    dist.all_gather_object(layouts, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    ref = layouts[0]
    for r, other in enumerate(layouts[1:], start=1):
        diff = {k: (ref[k], other[k]) for k in ref if ref[k] != other[k]}
        if diff:
            # The group's ranks: DCP ranks, or cp ranks under PCP.
            who = "DCP" if cfg.prefill_context_parallel_size == 1 else "CP"
            shown = ", ".join(f"{k}: {who} rank 0 (global {ranks[0]}) has {a!r}, {who} rank {r} "
                              f"(global {ranks[r]}) has {b!r}" for k, (a, b) in diff.items())
            fix = ("DCP ranks must share KV heads: choose tp, num_kv_heads and dcp so that dcp divides "
                   "tp // num_kv_heads (cfg.validate_for(model.attention_spec()))" if "kv_head_ids" in diff else
                   "allocate the cache with the same config, model spec, num_blocks and dtype on every rank")
            raise ConfigError("the ranks of a DCP group hold the same KV-cache layout "
                              "(the pcp * dcp ranks of the context-parallel group under PCP)", shown, fix)


def allocate_kv_cache(cfg: CPConfig, spec: KVCacheSpec, num_blocks: int,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                      attention: AttentionSpec | None = None, check_layout: bool = True,
                      scratch_block: bool = False, parallel: ParallelState | None = None) -> KVCache:
    """Allocate this rank's shard: `num_blocks` pages of `cfg.block_size` tokens per layer.

    The token capacity of the whole context-parallel group is
    `num_blocks * block_size * pcp * dcp` (`cfg.virtual_block_size` per block).
    Pass `attention` to validate the config against the model first.

    With DCP or PCP on an initialised parallel state (pcp * dcp > 1) this is collective
    over the context-parallel group: every rank of the group must call it, and the ranks compare their
    cache layouts (`check_dcp_layout`, one small all-gather) so that a group holding
    different KV heads fails here with `ConfigError` on every rank instead of merging
    the wrong partials later. `check_layout=False` skips it (meta-device allocations,
    which hold no data, never check).

    `scratch_block=True` (needed by torchair's GE graph mode, `torchair_mode="max-autotune"`):
    every cache tensor gets one more page, block `num_blocks`, where the GE graphs write
    the tokens that write nothing (slot -1; `ops/core/scratch_block.py`, issue 21). Block ids
    stay `[0, num_blocks)`: use `BlockAllocator(num_blocks, ...)`; a block table naming
    the scratch block is refused by the step check.

    `parallel`: the `ParallelState` of `init_parallel` this cache belongs to (its TP
    rank picks the KV heads, its cp group checks the layout). Left None, the current
    one is read here, once (this is a front door); nothing below reads the global.
    """
    if attention is not None:
        cfg.validate_for(attention)
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks={num_blocks!r} must be an integer >= 1")
    state = parallel if parallel is not None else parallel_state_or_none()
    if state is not None and cfg.context_parallel_size > 1:
        mismatch = {k: (getattr(cfg, k), getattr(state.cfg, k)) for k in
                    ("tensor_parallel_size", "decode_context_parallel_size", "prefill_context_parallel_size",
                     "cp_kv_cache_interleave_size", "block_size", "kv_cache_dtype")
                    if getattr(cfg, k) != getattr(state.cfg, k)}
        if mismatch:
            raise ConfigError("allocate_kv_cache config == init_parallel config (DCP / PCP)",
                              ", ".join(f"{k}={a} here but {b} in init_parallel" for k, (a, b) in mismatch.items()),
                              "allocate the DCP cache with the CPConfig passed to cp_compile.init_parallel")
        if spec.kind == "gqa" and not spec.kv_head_ids and attention is not None:
            spec = KVCacheSpec(**{**asdict(spec), "kv_head_ids": tp_kv_head_ids(
                attention.num_kv_heads, cfg.tensor_parallel_size, state.layout.tp.rank)})
    if check_layout and torch.device(device).type != "meta":
        check_dcp_layout(cfg, spec, num_blocks, dtype, parallel=state)
    page_dtype = KV_CACHE_DTYPES[cfg.kv_cache_dtype] or dtype  # quantised pages, or the model's dtype
    bs = cfg.block_size
    pages = num_blocks + int(scratch_block)  # the scratch block is the last page
    layers: list[tuple[torch.Tensor, ...]] = []
    replicated: list[torch.Tensor] = []
    for _ in range(spec.num_layers):
        if spec.kind == "gqa":
            if spec.num_kv_heads_per_rank < 1 or spec.head_dim < 1:
                raise ValueError("GQA cache needs num_kv_heads_per_rank >= 1 and head_dim >= 1")
            k = torch.zeros(pages, bs, spec.num_kv_heads_per_rank, spec.head_dim, dtype=page_dtype, device=device)
            v = torch.zeros(pages, bs, spec.num_kv_heads_per_rank, spec.v_head_dim or spec.head_dim,
                            dtype=page_dtype, device=device)
            if cfg.kv_cache_quantized:  # one fp32 scale per (page, offset, KV head), beside the pages
                layers.append((k, v, *(torch.zeros(pages, bs, spec.num_kv_heads_per_rank, dtype=torch.float32,
                                                   device=device) for _ in range(2))))
            else:
                layers.append((k, v))
        elif spec.kind in ("mla", "sfa"):
            if spec.latent_dim < 1:
                raise ValueError("MLA cache needs latent_dim >= 1 (kv_lora_rank + rope dim)")
            latent = torch.zeros(pages, bs, spec.latent_dim, dtype=page_dtype, device=device)
            if cfg.kv_cache_quantized:  # one fp32 scale per token for [c | k_pe]
                layers.append((latent, torch.zeros(pages, bs, 1, dtype=torch.float32, device=device)))
            else:
                layers.append((latent,))
            if spec.kind == "sfa":
                # Replicated: full virtual blocks of block_size * pcp * dcp tokens on every rank.
                # In the model's dtype even with a quantised latent (issue 39: the indexer's keys
                # are not quantised unless a checkpoint says so; none is read).
                replicated.append(torch.zeros(pages, cfg.virtual_block_size, spec.index_dim, dtype=dtype,
                                              device=device))
        else:
            raise ValueError(f"unknown cache kind {spec.kind!r}; use 'gqa', 'mla' or 'sfa'")
    if cfg.context_parallel_size > 1:
        # The cache knows its layout (issue 19): a single-device attention op run over
        # it would read and write global slots in a 1/N shard. The storage is marked,
        # so views keep the mark; every single-device op and validate_step(...,
        # single_device_ops=True) refuse it (ops/core/sharded_cache.py).
        for layer in layers:
            for t in layer:
                mark_sharded(t, cfg.context_parallel_size)
    if scratch_block and torch.device(device).type != "meta":
        for t in [t for layer in layers for t in layer] + replicated:
            mark_scratch_block(t)
    return KVCache(layers=layers, block_size=bs, num_blocks=num_blocks, replicated=replicated,
                   kv_cache_dtype=cfg.kv_cache_dtype)
