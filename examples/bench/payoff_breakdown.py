"""Why DCP's tokens/s gain is what it is: one step of the payoff trace, profiled per rank.

On `world` gloo ranks (run_on_ranks), each builds the engine exactly as `LLM` does
(`build_engine`, same checkpoint, budget, block size, lowering), prefills `batch`
requests of `context` tokens, then profiles `steps` decode steps of that batch and
one prefill of a `context`-token prompt (alone). Each step is split by
`examples/bench/profile.py` into attention / dcp_local / dcp_comm / tp_comm / other
(other = projections and MLP GEMMs, norms, rope, Python; its largest ops are listed),
in ms, the max over ranks of each rank's median.

Used by examples/bench_dcp_payoff.py `--breakdown`: each dcp at the batch its pool
holds at the trace's mean context (dcp 2: about 2x dcp 1's).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from examples.bench.profile import STEP, breakdown, median_breakdown, profiling


def _world(rank: int, world: int, ckpt: str, tp: int, dcp: int, budget: int, block: int, max_len: int,
           lowering: str, context: int, batch: int, steps: int) -> dict[str, Any]:
    from cp_compile.runtime.parallel_state import destroy_parallel
    from cp_compile.serving.entrypoints.executors import EngineArgs, build_engine
    from cp_compile.serving.loop.scheduler import StepPlan

    engine = build_engine(EngineArgs(model=ckpt, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                                     block_size=block, max_model_len=max_len, max_num_seqs=64,
                                     kv_cache_memory_bytes=budget, lowering=lowering))
    if batch <= 0:  # as many requests of `context` (+ the steps) as the pool holds at once
        per_request = -(-(context + steps + 4) // (block * dcp))
        batch = engine.kv_pool.num_blocks // per_request
    g = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(3, vocab, (context,), generator=g).tolist() for _ in range(batch)]
    for rid, p in enumerate(prompts):  # prefill one by one (the trace's arrivals are staggered)
        engine.execute(StepPlan([(rid, 0, p)]))
    pos = context
    for _ in range(2):  # warm-up decode steps
        engine.execute(StepPlan([(rid, pos, [5]) for rid in range(batch)]))
        pos += 1
    with profiling(True) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"{STEP}:decode"):
                engine.execute(StepPlan([(rid, pos, [5]) for rid in range(batch)]))
            pos += 1
        extra = torch.randint(3, vocab, (context,), generator=g).tolist()
        engine.execute(StepPlan([], list(range(batch))))  # free the batch: room for the prefill
        with torch.profiler.record_function(f"{STEP}:prefill"):
            engine.execute(StepPlan([(batch, 0, extra)]))
    out = {side: median_breakdown(breakdown(prof, f"{STEP}:{side}")) for side in ("decode", "prefill")}
    out["batch"] = batch
    per_rank: list[Any] = [None] * world
    dist.all_gather_object(per_rank, out)
    destroy_parallel()
    return per_rank if rank == 0 else None


def step_breakdown(ckpt: str, tp: int, dcp: int, budget: int, block: int, max_len: int, lowering: str,
                   context: int, batch: int = 0, steps: int = 4) -> dict[str, Any]:
    """The max over ranks of each category (ms), decode (at `batch`; 0: as many requests
    of `context` as the KV pool holds) and prefill (one prompt)."""
    from cp_compile.testing.multirank import run_on_ranks

    t0 = time.perf_counter()
    per_rank = run_on_ranks(_world, tp, ckpt, tp, dcp, budget, block, max_len, lowering, context, batch, steps,
                            timeout=900)[0]
    out: dict[str, Any] = dict(dcp=dcp, batch=per_rank[0]["batch"], context=context, steps=steps)
    for side in ("decode", "prefill"):
        rows = [r[side] for r in per_rank]
        out[side] = {k: max(r[k] for r in rows) for k in rows[0] if k != "other_ops"}
        out[side]["other_ops_rank0"] = rows[0]["other_ops"]
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out
