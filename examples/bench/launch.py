"""Worlds of ranks: one world per (dcp, merge), spawned gloo ranks or torchrun processes.

A benchmark hands in `world_fn(rank, world_size, args, world, source, device) -> rows`
(module level, so spawned ranks can import it; `world` is `(dcp, merge)`) and
`source`: whatever its ranks need to build the model (picklable: shipped to
spawned ranks). Progress goes to stderr, results to stdout.
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist

from cp_compile.testing.multirank import run_on_ranks
from examples.bench.args import BenchArgs
from examples.bench.rows import merge_repeats

World = tuple[int, str]  # (dcp, merge)
WorldFn = Callable[[int, int, BenchArgs, World, Any, torch.device], list[dict[str, Any]]]


def log(rank: int, msg: str) -> None:
    """Progress line from rank 0, on stderr."""
    if rank == 0:
        print(msg, file=sys.stderr, flush=True)


def _spawned_rank(rank: int, world_size: int, world_fn: WorldFn, args: BenchArgs, world: World, source: Any,
                  nccl_store: str | None) -> list[dict[str, Any]]:
    """Entry point of a rank spawned by `run_on_ranks` (gloo already initialised)."""
    device = torch.device("cpu")
    if nccl_store is not None:
        # run_on_ranks sets up gloo; CUDA collectives need NCCL, so re-initialise the world.
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.destroy_process_group()
        dist.init_process_group("nccl", init_method=f"file://{nccl_store}", rank=rank, world_size=world_size)
    return world_fn(rank, world_size, args, world, source, device)


def run_spawned(args: BenchArgs, world_fn: WorldFn, source: Any) -> list[dict[str, Any]]:
    """One spawned world of `args.ranks` ranks (tp, or tp * pcp) per (dcp, merge); rank 0's rows (already max
    over ranks)."""
    rows: list[dict[str, Any]] = []
    for i, (dcp, merge) in enumerate(args.schedule, 1):
        log(0, f"== world {i}/{len(args.schedule)} tp={args.tp} dcp={dcp} merge={merge}: spawning {args.ranks} ranks")
        with tempfile.TemporaryDirectory(prefix="bench_nccl_") as tmp:
            store = os.path.join(tmp, "store") if torch.cuda.is_available() else None
            per_rank = run_on_ranks(_spawned_rank, args.ranks, world_fn, args, (dcp, merge), source, store,
                                    timeout=3600)
        rows.extend(per_rank[0])
    return rows


def run_torchrun(args: BenchArgs, world_fn: WorldFn, make_source: Callable[[BenchArgs], Any]
                 ) -> list[dict[str, Any]]:
    """Every torchrun process runs each world in turn; returns rows on every rank."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if world_size != args.ranks:
        raise SystemExit(f"torchrun launched {world_size} processes but the world is {args.ranks} ranks "
                         f"(--tp {args.tp}, times --pcp where given): use --nproc-per-node={args.ranks}")
    source = make_source(args)  # seeded: identical weights on every rank
    rows: list[dict[str, Any]] = []
    for i, world in enumerate(args.schedule, 1):
        log(rank, f"== world {i}/{len(args.schedule)} tp={args.tp} dcp={world[0]} merge={world[1]} (torchrun)")
        rows.extend(world_fn(rank, world_size, args, world, source, device))
    return rows


def run(args: BenchArgs, world_fn: WorldFn, make_source: Callable[[BenchArgs], Any],
        post: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] = merge_repeats
        ) -> tuple[list[dict[str, Any]], bool]:
    """Run every world; (rows, whether this process should write the outputs).

    Under torchrun (env RANK set) only rank 0 writes; spawned worlds return rank 0's rows.
    `post` pools the rows of `--repeat` passes (rows of another shape bring their own).
    """
    if "RANK" in os.environ:
        rows = run_torchrun(args, world_fn, make_source)
        rank = dist.get_rank()
        dist.destroy_process_group()
        return post(rows), rank == 0
    return post(run_spawned(args, world_fn, make_source(args))), True
