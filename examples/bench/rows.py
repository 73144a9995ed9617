"""The JSON row of one measured config, and writing the rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import cp_compile
from examples.bench.args import BenchArgs
from examples.bench.models import comm_bytes_per_step
from examples.bench.timing import summarize


def decode_row(args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, context: int, batch: int,
               step_ms: list[float], used_blocks: int, pool: cp_compile.KVCache, graphs: int,
               recompiled: bool) -> dict[str, Any]:
    """One (dcp, context, batch) decode config; step times are already the max over ranks."""
    dtype = args.torch_dtype
    # Right-sized shard for this config (the pages it used), measured off a meta allocation.
    used = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), used_blocks, dtype=dtype, device="meta")
    dcp_bytes, tp_bytes = comm_bytes_per_step(model, batch, args.tp, cfg.dcp, args.merge, dtype)
    return dict(
        kind=args.model, tp=args.tp, dcp=cfg.dcp, interleave=args.interleave, batch=batch, context_len=context,
        **summarize(step_ms),
        step_ms=step_ms,
        kv_cache_bytes_per_rank=used.sharded_bytes, max_context_tokens_per_rank=used.tokens_per_rank,
        kv_blocks_per_rank=used_blocks,
        pool_kv_cache_bytes_per_rank=pool.sharded_bytes, pool_tokens_per_rank=pool.tokens_per_rank,
        comm_bytes_per_step=dcp_bytes, tp_allreduce_bytes_per_step=tp_bytes,
        lowering=args.lowering, dtype=args.dtype, merge=args.merge, block_size=args.block_size,
        warmup=args.warmup, steps=args.steps, graphs_compiled=graphs, recompiled_in_timed_steps=recompiled,
        device=str(pool.layers[0][0].device.type),
    )


def write_json(rows: list[dict[str, Any]], out: Path, name: str) -> Path:
    path = out / name
    path.write_text(json.dumps(rows, indent=1))
    return path
