"""The prefill sweep of one world: TTFT of DCP and its dcp = 1 baseline, step by step.

The world is the decode benchmark's (`decode.build_sides`): the same model compiled
with cp_ascend at the world's dcp and, beside it, with the plain lowering over a
dcp = 1 pool; their steps alternate (AB, BA, ...) so that a slow spell of a shared
machine hits both alike (docs/benchmarks_log.md, "What is measured").

Per (prompt, batch) two variants, each its own config:

- `full`: one step prefills `batch` requests of `prompt` tokens each, from an empty
  cache (the TTFT of a prompt that fits one step);
- `chunked` (`--prefix P`, P < prompt): the first P tokens of each request are
  already cached, written straight into each rank's shard (`cache.fill_context`,
  as decode fills its context), and the step prefills the remaining `prompt - P`
  (the last chunk of a chunked prefill, or a prompt hitting a prefix cache).

Every step of a config repeats the same step: the same slots are rewritten with
the same positions, so each step does the same work and the cached prefix is left
as it was. The pool of each side is allocated once per world for the largest
(prompt, batch), so the cache tensors (graph inputs) keep their shapes.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

import cp_compile
from examples.bench.args import PrefillArgs
from examples.bench.cache import fill_context, reserve
from examples.bench.decode import Side, alternate_steps, build_sides, init_world, merge_decision
from examples.bench.dsa_cp import build_dsa_cp_sides, init_dsa_cp_world
from examples.bench.launch import World, log
from examples.bench.pcp import build_pcp_sides, init_pcp_world
from examples.bench.profile import CATEGORIES
from examples.bench.rows import add_paired_ratios, prefill_row
from examples.bench.shapes import ModelSource

Result = tuple[list[float], int, list[dict[str, float]]]  # step ms, recompiles after warm-up, per-rank breakdown


def run_world(rank: int, world_size: int, args: PrefillArgs, world: World, source: ModelSource,
              device: torch.device) -> list[dict[str, Any]]:
    """One (dcp, merge) world, with its baseline when dcp > 1: compile, sweep (prompt, batch, variant)."""
    if args.dsa_cp:  # one world: DSA-CP off vs on (examples/bench/dsa_cp.py)
        state = init_dsa_cp_world(args, device)
    elif args.pcp > 1:  # one world of tp * pcp ranks: pcp = 1 vs PCP (examples/bench/pcp.py)
        state = init_pcp_world(args, device)
    else:
        state = init_world(args, world, device)
    try:
        if args.dsa_cp:
            model, sides = build_dsa_cp_sides(rank, world_size, args, source, state, device,
                                              tokens_per_req=max(args.prompt))
        elif args.pcp > 1:
            model, sides = build_pcp_sides(rank, args, source, state, device, tokens_per_req=max(args.prompt))
        else:
            model, sides = build_sides(rank, world_size, args, world, source, state, device,
                                       tokens_per_req=max(args.prompt))
        rows = []
        for prompt in args.prompt:
            for batch in args.batch:
                for prefix in args.chunks(prompt):
                    rows += measure(rank, args, model, sides, world, prompt, prefix, batch, source, device)
        return rows
    finally:
        cp_compile.destroy_parallel()
        torch._dynamo.reset()  # under torchrun the next world reuses this process


def timed_prefill(sides: list[Side], allocs: list[cp_compile.BlockAllocator], prompt: int, prefix: int,
                  batch: int, args: PrefillArgs, vocab: int, device: torch.device) -> list[Result]:
    """`alternate_steps` over identical prefill steps of `batch` x (`prompt` - `prefix`) tokens."""
    new = prompt - prefix
    # The metadata is the same every step (same slots, same positions): built once, outside the timing.
    metas = [cp_compile.build_attention_metadata([(prefix, new)] * batch, alloc,
                                                 max_blocks_per_req=side.geom.max_blocks_per_req, device=device)
             for side, alloc in zip(sides, allocs)]
    g = torch.Generator().manual_seed(prompt * 131 + prefix * 7 + batch)

    def inputs(step: int) -> list[tuple[torch.Tensor, Any]]:
        ids = torch.randint(0, vocab, (batch * new,), generator=g).to(device)
        return [(ids, meta) for meta in metas]

    return alternate_steps(sides, inputs, args, device)


def measure(rank: int, args: PrefillArgs, model: torch.nn.Module, sides: list[Side], world: World, prompt: int,
            prefix: int, batch: int, source: ModelSource, device: torch.device) -> list[dict[str, Any]]:
    """Fill the prefix, warm up, time and profile one config on every side; their JSON rows."""
    t0 = time.perf_counter()
    allocs = []
    for side in sides:
        alloc = reserve(side.geom, side.cfg, batch, prompt)
        if prefix:
            fill_context(side.cache, side.cfg, side.dcp_rank, alloc, prefix, batch, device,
                         seed=1000 * side.dcp_rank + prefix)
        allocs.append(alloc)
    results = timed_prefill(sides, allocs, prompt, prefix, batch, args, source.vocab_size, device)
    rows = []
    for side, alloc, (step_ms, recompiles, per_rank) in zip(sides, allocs, results):
        cfg, decision = side.cfg, merge_decision(side)
        if cfg.dcp_merge == "auto" and decision is not None:  # the bytes of the merge the pass chose
            cfg = dataclasses.replace(cfg, dcp_merge=decision["merge"])
        row = prefill_row(args, model, cfg, side.merge, prompt, prefix, batch, step_ms,
                          side.geom.num_blocks - alloc.num_free, side.cache, side.graphs(), recompiles, per_rank,
                          world)
        bd = row["breakdown_ms"]
        parts = ", ".join(f"{k} {bd[k]:.1f}" for k in CATEGORIES) if bd else "no profile"
        log(rank, f"[dcp={side.cfg.decode_context_parallel_size} pcp={side.cfg.prefill_context_parallel_size} {side.merge}] prompt={prompt:>6} prefix={prefix:>6} batch={batch:>3}: TTFT "
                  f"{row['ttft_ms']:9.1f} ms (steps {', '.join(f'{t:.1f}' for t in step_ms)}), graphs "
                  f"{row['graphs_compiled']}{f' RECOMPILED {recompiles} AFTER WARM-UP' if recompiles else ''}; "
                  f"profiled ms: {parts}")
        rows.append(row)
    add_paired_ratios(rows, "ttft_ratio_paired")
    log(rank, f"  [{time.perf_counter() - t0:.1f} s]")
    return rows
