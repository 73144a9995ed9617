"""KV pool geometry per world, and filling a cached context straight into a rank's shard."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import cp_compile
from cp_compile.ops.core import layout


@dataclass(frozen=True)
class WorldGeometry:
    """KV pool shapes fixed for a whole world, so configs do not change graph inputs."""

    num_blocks: int  # per-rank pages in the pool
    max_blocks_per_req: int  # block-table width


def world_geometry(block_size: int, dcp: int, max_context: int, max_batch: int, decode_steps: int) -> WorldGeometry:
    """Pages for the largest (context, batch) config plus a little slack."""
    vbs = block_size * dcp
    blocks_per_req = math.ceil((max_context + decode_steps) / vbs)
    return WorldGeometry(num_blocks=max_batch * blocks_per_req + 2, max_blocks_per_req=blocks_per_req)


def reserve(geom: WorldGeometry, cfg: cp_compile.CPConfig, batch: int, tokens: int) -> cp_compile.BlockAllocator:
    """A fresh allocator with every page `batch` requests of `tokens` tokens need, reserved up front."""
    alloc = cp_compile.BlockAllocator(geom.num_blocks, cfg.virtual_block_size)
    for rid in range(batch):
        alloc.ensure(rid, tokens)
    return alloc


def fill_context(cache: cp_compile.KVCache, cfg: cp_compile.CPConfig, dcp_rank: int, alloc: cp_compile.BlockAllocator,
                 context: int, batch: int, device: torch.device, seed: int) -> None:
    """Write `context` random tokens of each of `batch` requests into this rank's shard.

    The global slot mapping of a (0, context) prefill is localised exactly as the
    DCP pass does it, so each rank stores only the tokens it owns, at the slots the
    decode steps will read. Under PCP the cache is sharded over N = pcp * dcp ranks
    by the same rule (docs/pcp.md §2): pass the cp rank as `dcp_rank`. A replicated cache (SFA's indexer keys) gets every token, at the
    global slots (its pages are whole virtual blocks).
    """
    meta = cp_compile.build_attention_metadata([(0, context)] * batch, alloc)
    slots = layout.local_slot_mapping(meta.slot_mapping, cp=cfg.context_parallel_size, rank=dcp_rank, interleave=cfg.cp_kv_cache_interleave_size,
                                      block_size=cfg.block_size).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in cache.layers:
        for t in layer:
            new = torch.randn(slots.shape[0], *t.shape[2:], generator=g, device=device, dtype=torch.float32)
            torch.ops.cp.cache_write(new.to(t.dtype), t, slots)
    global_slots = meta.slot_mapping.to(device)
    for t in cache.replicated:
        new = torch.randn(global_slots.shape[0], *t.shape[2:], generator=g, device=device, dtype=torch.float32)
        torch.ops.cp.cache_write(new.to(t.dtype), t, global_slots)
