"""The KV pool sized from a per-rank memory budget (vLLM's `kv_cache_memory_bytes`).

A block on one rank holds `block_size` tokens of every layer: its bytes are the
DCP-sharded caches' (K/V heads of this TP rank, or the MLA latent) plus SFA's
replicated indexer cache, which holds the group's `block_size * dcp` tokens. So

    num_blocks       = kv_cache_memory_bytes // bytes_per_block
    tokens_per_rank  = num_blocks * block_size
    tokens_per_group = tokens_per_rank * dcp * pcp        (each rank stores 1/(dcp*pcp) of a request)
    max_concurrency  = num_blocks // ceil(max_model_len / (block_size * dcp * pcp))

The same bytes at dcp N serve N x the tokens (less where SFA's replicated indexer
cache grows with dcp). The scheduler admits a request when its whole budget
(prompt + max_tokens) fits in the free blocks and queues the rest (continuous
batching), so `max_concurrency` requests of `max_model_len` run at once, capped by
`max_num_seqs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from cp_compile.base.config import ConfigError, CPConfig
from cp_compile.runtime.kv_cache import allocate_kv_cache
from cp_compile.serving.hf.engine import kv_cache_spec


def bytes_per_block(cfg: CPConfig, hf_config: Any, dtype: torch.dtype, tp_rank: int = 0) -> int:
    """One block's bytes on TP rank `tp_rank` (sharded + replicated caches), from a
    one-block cache on the meta device (nothing allocated, the engine's own layout)."""
    spec = kv_cache_spec(hf_config, cfg.tensor_parallel_size, tp_rank)
    cache = allocate_kv_cache(cfg, spec, 1, dtype=dtype, device="meta", check_layout=False)
    return cache.sharded_bytes + cache.replicated_bytes


def scale_bytes_per_block(cfg: CPConfig, hf_config: Any, dtype: torch.dtype, tp_rank: int = 0) -> int:
    """The part of `bytes_per_block` that is a quantised cache's fp32 scales (0 for
    kv_cache_dtype "auto"; issue 39), for the start-up report."""
    spec = kv_cache_spec(hf_config, cfg.tensor_parallel_size, tp_rank)
    return allocate_kv_cache(cfg, spec, 1, dtype=dtype, device="meta", check_layout=False).scale_bytes


@dataclass(frozen=True)
class KVPool:
    num_blocks: int
    block_bytes: int
    tokens_per_rank: int
    tokens_per_group: int
    max_model_len: int
    max_concurrency: int  # requests of max_model_len the blocks hold at once
    max_num_seqs: int
    # Reserved out of the budget for the weights the merge rewrites gather (gathered_weights.py)
    gathered_weight_bytes: int = 0
    block_scale_bytes: int = 0  # the part of block_bytes that is quantisation scales (issue 39)
    kv_cache_dtype: str = "auto"

    def lines(self) -> list[str]:
        """The start-up report (vLLM's "GPU KV cache size" / "Maximum concurrency" lines)."""
        bs = self.tokens_per_rank // self.num_blocks if self.num_blocks else 0
        split = ""
        if self.block_scale_bytes:  # a quantised cache: its scales are in the blocks, and so in the capacity
            pages = self.block_bytes - self.block_scale_bytes
            split = (f" ({self.kv_cache_dtype} pages {pages:,d} B + fp32 scales {self.block_scale_bytes:,d} B per "
                     f"block; per token {pages // bs:,d} + {self.block_scale_bytes // bs:,d} B)")
        return [f"KV cache: {self.num_blocks} blocks x {self.block_bytes:,d} B = "
                f"{self.num_blocks * self.block_bytes:,d} B per rank" + split,
                f"KV cache size: {self.tokens_per_rank:,d} tokens per rank, {self.tokens_per_group:,d} tokens per "
                "DCP group",
                f"Maximum concurrency for {self.max_model_len:,d} tokens per request: {self.max_concurrency} "
                f"(admitted: {min(self.max_concurrency, self.max_num_seqs)}, max_num_seqs={self.max_num_seqs})",
                f"Gathered weights (all-reduce fold / project before the merge): {self.gathered_weight_bytes:,d} B "
                "per rank, taken out of the KV budget"]


def check_budget(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError("kv_cache_memory_bytes is a positive integer (bytes per rank)",
                          f"kv_cache_memory_bytes={value!r}", "pass the KV pool's bytes per rank, e.g. 8 * 2**30, "
                          "or None to size the pool from max_model_len x max_num_seqs")


def plan_pool(cfg: CPConfig, block_bytes: int, max_model_len: int, max_num_seqs: int,
              kv_cache_memory_bytes: int | None = None, num_blocks: int | None = None,
              reserved_bytes: int = 0, block_scale_bytes: int = 0) -> KVPool:
    """The pool: `num_blocks` if given, else from `kv_cache_memory_bytes` less `reserved_bytes`
    (the weights the merge rewrites gather, gathered_weights.py), else `max_num_seqs` requests
    of `max_model_len` (+1 block). A budget that cannot hold one request of `max_model_len` is
    refused, naming the bytes it needs. `block_scale_bytes`: the part of `block_bytes` that is
    quantisation scales (reported, already counted in `block_bytes`)."""
    check_budget(kv_cache_memory_bytes)
    vbs = cfg.virtual_block_size
    per_request = math.ceil(max_model_len / vbs)
    if num_blocks is None and kv_cache_memory_bytes is not None:
        num_blocks = max(kv_cache_memory_bytes - reserved_bytes, 0) // block_bytes
        if num_blocks < per_request:
            reserved = f" less {reserved_bytes:,d} B of gathered weights" if reserved_bytes else ""
            raise ConfigError("kv_cache_memory_bytes holds one request of max_model_len",
                              f"kv_cache_memory_bytes={kv_cache_memory_bytes:,d}{reserved}: {num_blocks} blocks of "
                              f"{block_bytes:,d} B on this rank; max_model_len={max_model_len} needs {per_request}",
                              f"kv_cache_memory_bytes >= {per_request * block_bytes + reserved_bytes:,d}, a smaller "
                              "max_model_len, or a larger decode_context_parallel_size")
    elif num_blocks is None:
        num_blocks = per_request * max_num_seqs + 1
    n = cfg.decode_context_parallel_size * cfg.prefill_context_parallel_size
    return KVPool(num_blocks=num_blocks, block_bytes=block_bytes, tokens_per_rank=num_blocks * cfg.block_size,
                  tokens_per_group=num_blocks * cfg.block_size * n, max_model_len=max_model_len,
                  max_concurrency=num_blocks // per_request, max_num_seqs=max_num_seqs,
                  gathered_weight_bytes=reserved_bytes, block_scale_bytes=block_scale_bytes,
                  kv_cache_dtype=cfg.kv_cache_dtype)
