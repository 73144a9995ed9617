"""What the per-step metadata validation costs on a compiled decode step (issue 10).

Spawns `--tp` gloo ranks (or runs one process with --tp 1), compiles the tiny
Qwen3-style model with cp_ascend at (tp, dcp), and times decode steps of `--batch`
requests at `--context` cached tokens with validation on and off, interleaved step
by step (same compiled graph, same inputs), each step between barriers, the slowest
rank's time. Prints the median TPOT of each, their ratio, and the median time of the
validation alone (`validate_forward_args` on the same arguments) as a fraction of
the median TPOT without it. Validation is turned off per compiled model with
`compiled.validate_inputs = False` (or `model.cp_compiled.validate_inputs = False`).

    python -m examples.bench_validation --tp 2 --dcp 2 --context 512 --batch 8 --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import cp_compile
from cp_compile.runtime.metadata_checks import validate_forward_args
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import example_from_config, hf_qwen3

BLOCK = 16


def _slowest(ms: float) -> float:
    t = torch.tensor([ms], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _world(rank: int, world: int, args: argparse.Namespace, hf_config: Any, state_dict: dict) -> dict:
    torch.manual_seed(0)
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=args.dcp, block_size=BLOCK)
    state = cp_compile.init_parallel(cfg, device="cpu")
    model = example_from_config(hf_config, state_dict, world, state.layout.tp.rank, state.tp_group)
    per_req = -(-(args.context + args.warmup + args.steps + 1) // cfg.virtual_block_size)
    num_blocks = per_req * args.batch + 1
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), num_blocks, attention=model.attention_spec())
    compiled = cp_compile.compile_model(model, lowering=args.lowering)
    alloc = cp_compile.BlockAllocator(num_blocks, cfg.virtual_block_size)
    on, off, alone = [], [], []
    g = torch.Generator().manual_seed(1)
    for step in range(args.warmup + args.steps):
        meta = cp_compile.build_attention_metadata([(args.context + step, 1)] * args.batch, alloc,
                                                   max_blocks_per_req=per_req)
        ids = torch.randint(0, hf_config.vocab_size, (args.batch,), generator=g)
        # Alternate which mode goes first, so neither always runs on a warmer cache.
        for validate in ((True, False) if step % 2 == 0 else (False, True)):
            compiled.validate_inputs = validate
            dist.barrier()
            t0 = time.perf_counter()
            with torch.no_grad():
                compiled(ids, meta.positions, cache.layers, meta)
            ms = _slowest((time.perf_counter() - t0) * 1e3)
            if step >= args.warmup:
                (on if validate else off).append(ms)
        t0 = time.perf_counter()
        validate_forward_args({"input_ids": ids, "positions": meta.positions, "kv_caches": cache.layers,
                               "meta": meta})
        if step >= args.warmup:
            alone.append((time.perf_counter() - t0) * 1e3)
    return dict(on=on, off=off, alone=alone, graphs=len(compiled.backend.pass_managers))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode (>= 10)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lowering", default="inductor", choices=["inductor", "aot_eager", "eager"])
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.steps < 10:
        ap.error("--steps must be >= 10 (the figure is a median)")
    hf = hf_qwen3(num_kv_heads=max(1, args.tp // args.dcp), num_heads=max(4, args.tp))
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    res = run_on_ranks(_world, args.tp, args, hf.config, sd, timeout=1800)[0]
    med_on, med_off = statistics.median(res["on"]), statistics.median(res["off"])
    med_alone = statistics.median(res["alone"])
    out = dict(tp=args.tp, dcp=args.dcp, context=args.context, batch=args.batch, steps=args.steps,
               lowering=args.lowering, tpot_ms_validate_on=med_on, tpot_ms_validate_off=med_off,
               tpot_ratio_on_over_off=med_on / med_off, validate_ms=med_alone,
               validate_fraction_of_tpot=med_alone / med_off, graphs_compiled=res["graphs"])
    print(f"tp={args.tp} dcp={args.dcp} context={args.context} batch={args.batch} lowering={args.lowering}, "
          f"median of {args.steps} steps each (interleaved):")
    print(f"  TPOT validation on : {med_on:8.3f} ms")
    print(f"  TPOT validation off: {med_off:8.3f} ms")
    print(f"  ratio on / off     : {med_on / med_off:8.3f}")
    print(f"  validation alone   : {med_alone:8.3f} ms = {100 * med_alone / med_off:.1f} % of the TPOT without it")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
