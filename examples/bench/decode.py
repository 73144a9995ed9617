"""The decode sweep of one world: compile once, then per (context, batch) fill, warm up, time, profile.

- the KV pool is allocated once per world, big enough for the largest config, so
  the cache tensors (graph inputs) keep their shapes across configs; the block
  table width is fixed per world for the same reason;
- the context is filled directly (`cache.fill_context`), so decode attends over
  `context` cached tokens without a long prefill on CPU;
- `warmup` decode steps (which absorb any recompile for a new batch size), then
  `steps` timed decode steps of `batch` requests, one new token each, positions
  advancing; each step is bracketed by barriers, its time is the max over ranks;
- then `profile_steps` more steps under the torch profiler on every rank, for the
  per-step breakdown (`profile.py`); they are not in the TPOT (profiling costs time);
- with `compile_probe`, after the sweep: a fresh compile of the same model with the
  plain lowering, with cp_ascend, and with the plain lowering again (`compile_probe`).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

import cp_compile
from cp_compile.decorator import CompiledForward
from examples.bench.args import BenchArgs
from examples.bench.cache import WorldGeometry, fill_context, reserve, world_geometry
from examples.bench.launch import World, log
from examples.bench.profile import CATEGORIES, STEP, breakdown, median_breakdown, profiling
from examples.bench.rows import decode_row
from examples.bench.shapes import ModelSource, model_source
from examples.bench.timing import max_over_ranks, timed_step

_DYNAMIC = ("input_ids", "positions", "meta")


def decode_source(args: BenchArgs) -> ModelSource:
    """What the ranks build the model from (tiny HF weights, or a shape preset)."""
    return model_source(args.shape, args.model, args.tp)


def _decode_inputs(context: int, step: int, batch: int, alloc: cp_compile.BlockAllocator, width: int, vocab: int,
                   g: torch.Generator, device: torch.device) -> tuple[torch.Tensor, Any]:
    meta = cp_compile.build_attention_metadata([(context + step, 1)] * batch, alloc, max_blocks_per_req=width,
                                               device=device)
    return torch.randint(0, vocab, (batch,), generator=g).to(device), meta


def timed_decode(compiled: Any, cache: cp_compile.KVCache, alloc: cp_compile.BlockAllocator, context: int,
                 batch: int, args: BenchArgs, geom: WorldGeometry, vocab: int, device: torch.device
                 ) -> tuple[list[float], int, list[dict[str, float]]]:
    """Warm-up, timed, then profiled decode steps.

    Returns each timed step's time in ms (max over ranks), the graphs compiled after
    the warm-up (max over ranks; their compile time would be in the TPOT), and each
    rank's median breakdown of the profiled steps (empty without profiling).
    """
    times = []
    graphs_after_warmup = len(compiled.backend.pass_managers)
    g = torch.Generator().manual_seed(context * 131 + batch)
    timed_end = args.warmup + args.steps

    def run_step(step: int, label: str) -> float:
        # Metadata and inputs are built outside the timed region: the runtime's job, not the model's.
        ids, meta = _decode_inputs(context, step, batch, alloc, geom.max_blocks_per_req, vocab, g, device)

        def step_fn() -> None:
            with torch.no_grad(), torch.profiler.record_function(label):
                compiled(ids, meta.positions, cache.layers, meta)

        return timed_step(step_fn, device)

    for step in range(timed_end):
        if step == args.warmup:
            graphs_after_warmup = len(compiled.backend.pass_managers)
        elapsed = run_step(step, "bench::timed")
        if step >= args.warmup:
            times.append(elapsed)
    # The profiler runs only around the extra steps: its overhead stays out of the TPOT.
    with profiling(args.profile_steps > 0) as prof:
        for step in range(timed_end, args.decode_steps):
            run_step(step, STEP)
    recompiles = len(compiled.backend.pass_managers) - graphs_after_warmup
    steps = breakdown(prof) if prof is not None else []
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, median_breakdown(steps))
    return max_over_ranks(times, device), int(max_over_ranks([float(recompiles)], device)[0]), per_rank


def compile_probe(model: torch.nn.Module, cfg: cp_compile.CPConfig, cache: cp_compile.KVCache, geom: WorldGeometry,
                  args: BenchArgs, vocab: int, device: torch.device) -> dict[str, float]:
    """Seconds to compile (and run once, batch 2, 16 tokens of context) a fresh copy of the model's
    forward: plain lowering, cp_ascend, plain again; max over ranks.

    Dynamo is reset before each, and Inductor's FX-graph and AOT caches are off, so each
    compile traces, runs its passes and lowers the whole graph; the kernel caches on disk
    stay warm (the sweep compiled the same kernels), as on any run but the very first.
    The plain run uses a dcp = 1 cache (its attention is the single-device op).
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    plain_cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, block_size=args.block_size)
    plain_geom = world_geometry(args.block_size, 1, 16, 2, 1)
    plain_cache = cp_compile.allocate_kv_cache(plain_cfg, model.kv_cache_spec(), plain_geom.num_blocks,
                                               dtype=args.torch_dtype, device=device)

    def once(plain: bool) -> float:
        torch._dynamo.reset()
        if plain:
            fn = CompiledForward(model, model.forward, _DYNAMIC, args.lowering)
            c, geo, kv = plain_cfg, plain_geom, plain_cache
        else:
            fn = cp_compile.compile_model(model, lowering=args.lowering)
            c, geo, kv = cfg, geom, cache
        alloc = reserve(geo, c, 2, 17)
        ids, meta = _decode_inputs(16, 0, 2, alloc, geo.max_blocks_per_req, vocab, torch.Generator().manual_seed(0),
                                   device)

        def step_fn() -> None:
            with torch.no_grad():
                fn(ids, meta.positions, kv.layers, meta)

        return timed_step(step_fn, device) / 1e3

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        secs = max_over_ranks([once(True), once(False), once(True)], device)
    torch._dynamo.reset()
    plain = statistics.fmean([secs[0], secs[2]])
    return dict(compile_s_cp_ascend=secs[1], compile_s_plain=plain, compile_s_plain_runs=[secs[0], secs[2]],
                compile_ratio=secs[1] / plain)


def run_world(rank: int, world_size: int, args: BenchArgs, world: World, source: ModelSource,
              device: torch.device) -> list[dict[str, Any]]:
    """One (dcp, merge) on an initialised world: compile once, sweep (context, batch)."""
    dcp, merge = world
    cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, decode_context_parallel_size=dcp,
                              cp_kv_cache_interleave_size=args.interleave, block_size=args.block_size,
                              dcp_merge=merge if dcp > 1 else "ag_rs")
    state = cp_compile.init_parallel(cfg, device=device)
    try:
        dtype = args.torch_dtype
        t0 = time.perf_counter()
        model = source.build(world_size, state.tp_rank, state.tp_group)
        # Parameters only: the rope inverse frequencies stay fp32 (as in HF).
        for p in model.parameters():
            p.data = p.data.to(device=device, dtype=dtype)
        model.to(device)
        geom = world_geometry(args.block_size, dcp, max(args.context), max(args.batch), args.decode_steps)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), geom.num_blocks, dtype=dtype,
                                             device=device, attention=model.attention_spec())
        log(rank, f"[dcp={dcp} {merge}] {args.shape} tp={args.tp}: model built in {time.perf_counter() - t0:.1f} s, "
                  f"pool {geom.num_blocks} pages x {args.block_size} tokens/rank "
                  f"({cache.sharded_bytes / 2**20:.2f} MiB KV/rank), compiling with {args.lowering}")
        compiled = cp_compile.compile_model(model, lowering=args.lowering)
        rows = []
        for context in args.context:
            for batch in args.batch:
                rows.append(measure(rank, args, model, cfg, merge, state.dcp_rank, cache, geom, compiled, context,
                                    batch, source, device))
        if args.compile_probe and dcp > 1:
            t0 = time.perf_counter()
            probe = compile_probe(model, cfg, cache, geom, args, source.vocab_size, device)
            log(rank, f"[dcp={dcp} {merge}] compile probe: cp_ascend {probe['compile_s_cp_ascend']:.1f} s, "
                      f"{args.lowering} {probe['compile_s_plain']:.1f} s, ratio {probe['compile_ratio']:.2f} "
                      f"[{time.perf_counter() - t0:.0f} s]")
            for r in rows:
                r.update(probe)
        return rows
    finally:
        cp_compile.destroy_parallel()
        torch._dynamo.reset()  # under torchrun the next world reuses this process


def measure(rank: int, args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, merge: str, dcp_rank: int,
            cache: cp_compile.KVCache, geom: WorldGeometry, compiled: Any, context: int, batch: int,
            source: ModelSource, device: torch.device) -> dict[str, Any]:
    """Fill, warm up, time and profile one (context, batch) config; returns its JSON row."""
    t0 = time.perf_counter()
    alloc = reserve(geom, cfg, batch, context + args.decode_steps)
    fill_context(cache, cfg, dcp_rank, alloc, context, batch, device, seed=1000 * dcp_rank + context)
    step_ms, recompiles, per_rank = timed_decode(compiled, cache, alloc, context, batch, args, geom,
                                                 source.vocab_size, device)
    graphs = len(compiled.backend.pass_managers)
    row = decode_row(args, model, cfg, merge, context, batch, step_ms, geom.num_blocks - alloc.num_free, cache,
                     graphs, recompiles, per_rank, source.real_layers)
    bd = row["breakdown_ms"]
    parts = ", ".join(f"{k} {bd[k]:.1f}" for k in CATEGORIES) if bd else "no profile"
    log(rank, f"[dcp={cfg.dcp} {merge}] context={context:>6} batch={batch:>3}: TPOT {row['tpot_ms']:8.2f} ms "
              f"(steps {', '.join(f'{t:.1f}' for t in step_ms)}), KV/rank "
              f"{row['kv_cache_bytes_per_rank'] / 2**20:.2f} MiB, graphs {graphs}"
              f"{f' RECOMPILED {recompiles} AFTER WARM-UP' if recompiles else ''}; profiled ms: {parts} "
              f"[{time.perf_counter() - t0:.1f} s]")
    return row
