"""The decode sweep of one world: compile once, then per (context, batch) fill, warm up, time.

- the KV pool is allocated once per world, big enough for the largest config, so
  the cache tensors (graph inputs) keep their shapes across configs; the block
  table width is fixed per world for the same reason;
- the context is filled directly (`cache.fill_context`), so decode attends over
  `context` cached tokens without a long prefill on CPU;
- `warmup` decode steps (which absorb any recompile for a new batch size), then
  `steps` timed decode steps of `batch` requests, one new token each, positions
  advancing; each step is bracketed by barriers, its time is the max over ranks.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import cp_compile
from examples.bench.args import BenchArgs
from examples.bench.cache import WorldGeometry, fill_context, reserve, world_geometry
from examples.bench.launch import log
from examples.bench.models import build_hf_model, hf_state_dict
from examples.bench.rows import decode_row
from examples.bench.timing import any_rank, max_over_ranks, timed_step


def hf_source(args: BenchArgs) -> tuple[Any, dict[str, torch.Tensor]]:
    """What the ranks build the model from: the tiny HF model's config and weights."""
    hf = build_hf_model(args.model, args.tp)
    return hf.config, hf_state_dict(hf)


def timed_decode(compiled: Any, cache: cp_compile.KVCache, alloc: cp_compile.BlockAllocator, context: int,
                 batch: int, args: BenchArgs, geom: WorldGeometry, vocab: int, device: torch.device
                 ) -> tuple[list[float], bool]:
    """Warm-up then timed decode steps.

    Returns each timed step's time in ms (max over ranks) and whether a graph was
    compiled during the timed steps (its compile time would then be in the TPOT).
    """
    times = []
    graphs_after_warmup = len(compiled.backend.pass_managers)
    g = torch.Generator().manual_seed(context * 131 + batch)
    for step in range(args.decode_steps):
        if step == args.warmup:
            graphs_after_warmup = len(compiled.backend.pass_managers)
        # Metadata and inputs are built outside the timed region: the runtime's job, not the model's.
        meta = cp_compile.build_attention_metadata([(context + step, 1)] * batch, alloc,
                                                   max_blocks_per_req=geom.max_blocks_per_req, device=device)
        ids = torch.randint(0, vocab, (batch,), generator=g).to(device)

        def step_fn() -> None:
            with torch.no_grad():
                compiled(ids, meta.positions, cache.layers, meta)

        elapsed = timed_step(step_fn, device)
        if step >= args.warmup:
            times.append(elapsed)
    recompiled = len(compiled.backend.pass_managers) > graphs_after_warmup
    return max_over_ranks(times, device), any_rank(recompiled, device)


def run_world(rank: int, world: int, args: BenchArgs, dcp: int, source: tuple[Any, dict[str, torch.Tensor]],
              device: torch.device) -> list[dict[str, Any]]:
    """One DCP size on an initialised world: compile once, sweep (context, batch)."""
    from examples.models.tiny import example_from_config

    hf_config, state_dict = source
    cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, decode_context_parallel_size=dcp,
                              cp_kv_cache_interleave_size=args.interleave, block_size=args.block_size,
                              dcp_merge=args.merge)
    state = cp_compile.init_parallel(cfg, device=device)
    try:
        dtype = args.torch_dtype
        model = example_from_config(hf_config, state_dict, world, state.tp_rank, state.tp_group)
        # Parameters only: the rope inverse frequencies stay fp32 (as in HF).
        for p in model.parameters():
            p.data = p.data.to(device=device, dtype=dtype)
        model.to(device)
        geom = world_geometry(args.block_size, dcp, max(args.context), max(args.batch), args.decode_steps)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), geom.num_blocks, dtype=dtype,
                                             device=device, attention=model.attention_spec())
        log(rank, f"[dcp={dcp}] tp={args.tp} pool {geom.num_blocks} pages x {args.block_size} tokens/rank "
                  f"({cache.sharded_bytes / 2**20:.2f} MiB KV/rank), compiling with {args.lowering}")
        compiled = cp_compile.compile_model(model, lowering=args.lowering)
        rows = []
        for context in args.context:
            for batch in args.batch:
                rows.append(measure(rank, args, model, cfg, state.dcp_rank, cache, geom, compiled,
                                    context, batch, hf_config.vocab_size, device))
        return rows
    finally:
        cp_compile.destroy_parallel()
        torch._dynamo.reset()  # under torchrun the next world reuses this process


def measure(rank: int, args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, dcp_rank: int,
            cache: cp_compile.KVCache, geom: WorldGeometry, compiled: Any, context: int, batch: int,
            vocab: int, device: torch.device) -> dict[str, Any]:
    """Fill, warm up and time one (context, batch) config; returns its JSON row."""
    t0 = time.perf_counter()
    alloc = reserve(geom, cfg, batch, context + args.decode_steps)
    fill_context(cache, cfg, dcp_rank, alloc, context, batch, device, seed=1000 * dcp_rank + context)
    step_ms, recompiled = timed_decode(compiled, cache, alloc, context, batch, args, geom, vocab, device)
    graphs = len(compiled.backend.pass_managers)
    row = decode_row(args, model, cfg, context, batch, step_ms, geom.num_blocks - alloc.num_free, cache,
                     graphs, recompiled)
    log(rank, f"[dcp={cfg.dcp}] context={context:>6} batch={batch:>3}: TPOT {row['tpot_ms']:8.2f} ms "
              f"(steps {', '.join(f'{t:.1f}' for t in step_ms)}), KV/rank "
              f"{row['kv_cache_bytes_per_rank'] / 2**20:.2f} MiB, graphs {graphs}"
              f"{' RECOMPILED IN TIMED STEPS' if recompiled else ''} [{time.perf_counter() - t0:.1f} s]")
    return row
