"""Step timing across ranks: barriers around each step, the slowest rank's time, the median."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_step(fn: Callable[[], object], device: torch.device) -> float:
    """Run `fn` between two barriers; this rank's time in ms (device work included)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    sync(device)
    elapsed = (time.perf_counter() - t0) * 1e3
    dist.barrier()
    return elapsed


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise max over ranks: the slowest rank sets each step's time."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def any_rank(flag: bool, device: torch.device) -> bool:
    t = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def summarize(step_ms: list[float], metric: str = "tpot") -> dict[str, float]:
    """A row's step-time fields (`metric`: "tpot" for decode, "ttft" for prefill): median (the
    figure), min and mean."""
    return {f"{metric}_ms": statistics.median(step_ms), f"{metric}_min_ms": min(step_ms),
            f"{metric}_mean_ms": statistics.fmean(step_ms)}
