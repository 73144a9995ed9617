"""Worlds of ranks: one world per DCP size, spawned gloo ranks or torchrun processes.

A benchmark hands in `world_fn(rank, world, args, dcp, source, device) -> rows`
(module level, so spawned ranks can import it) and `source`: whatever its ranks
need to build the model (picklable: shipped to spawned ranks).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist

from cp_compile.testing.multirank import run_on_ranks
from examples.bench.args import BenchArgs

WorldFn = Callable[[int, int, BenchArgs, int, Any, torch.device], list[dict[str, Any]]]


def log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def _spawned_rank(rank: int, world: int, world_fn: WorldFn, args: BenchArgs, dcp: int, source: Any,
                  nccl_store: str | None) -> list[dict[str, Any]]:
    """Entry point of a rank spawned by `run_on_ranks` (gloo already initialised)."""
    device = torch.device("cpu")
    if nccl_store is not None:
        # run_on_ranks sets up gloo; CUDA collectives need NCCL, so re-initialise the world.
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.destroy_process_group()
        dist.init_process_group("nccl", init_method=f"file://{nccl_store}", rank=rank, world_size=world)
    return world_fn(rank, world, args, dcp, source, device)


def run_spawned(args: BenchArgs, world_fn: WorldFn, source: Any) -> list[dict[str, Any]]:
    """One spawned world of `tp` ranks per DCP size; rank 0's rows (already max over ranks)."""
    rows: list[dict[str, Any]] = []
    for dcp in args.dcp:
        print(f"== world tp={args.tp} dcp={dcp}: spawning {args.tp} ranks", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench_nccl_") as tmp:
            store = os.path.join(tmp, "store") if torch.cuda.is_available() else None
            per_rank = run_on_ranks(_spawned_rank, args.tp, world_fn, args, dcp, source, store, timeout=3600)
        rows.extend(per_rank[0])
    return rows


def run_torchrun(args: BenchArgs, world_fn: WorldFn, make_source: Callable[[BenchArgs], Any]
                 ) -> list[dict[str, Any]]:
    """Every torchrun process runs each DCP world in turn; returns rows on every rank."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.tp:
        raise SystemExit(f"torchrun launched {world} processes but --tp {args.tp}: use --nproc-per-node={args.tp}")
    source = make_source(args)  # seeded: identical weights on every rank
    rows: list[dict[str, Any]] = []
    for dcp in args.dcp:
        log(rank, f"== world tp={args.tp} dcp={dcp} (torchrun)")
        rows.extend(world_fn(rank, world, args, dcp, source, device))
    return rows


def run(args: BenchArgs, world_fn: WorldFn, make_source: Callable[[BenchArgs], Any]
        ) -> tuple[list[dict[str, Any]], bool]:
    """Run every world; (rows, whether this process should write the outputs).

    Under torchrun (env RANK set) only rank 0 writes; spawned worlds return rank 0's rows.
    """
    if "RANK" in os.environ:
        rows = run_torchrun(args, world_fn, make_source)
        rank = dist.get_rank()
        dist.destroy_process_group()
        return rows, rank == 0
    return run_spawned(args, world_fn, make_source(args)), True
