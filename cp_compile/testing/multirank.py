"""Run a function on N locally spawned gloo ranks and collect per-rank results.

Used by tests, examples and benchmarks. The rendezvous is a FileStore in a fresh
temporary directory, so back-to-back worlds never race for a TCP port. An
exception on any rank fails the call with that rank's traceback; a world that
does not finish within `timeout` seconds is killed and raises `TimeoutError`.
"""

from __future__ import annotations

import io
import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A spawned rank raised; the message carries its traceback."""


def _worker(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, threads: int,
            args: tuple, kwargs: dict, results: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args, **kwargs)
        # Serialise here: tensors sent through the queue by shared memory would need
        # this process alive until the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything, including SystemExit
        results.put((rank, "error", traceback.format_exc()))
    finally:
        try:
            from cp_compile.parallel_state import destroy_parallel

            destroy_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown must not mask the result
            pass


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                 threads_per_rank: int = 1, **kwargs: Any) -> list[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks.

    `fn` must be importable (module level) and its arguments and result picklable.
    torch.distributed is initialised before `fn` runs; `fn` typically calls
    `cp_compile.init_parallel(cfg)`. Returns the results ordered by rank.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="cp_ranks_") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, r, world_size, store_path, threads_per_rank, args, kwargs, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(out) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"{world_size}-rank world did not finish in {timeout:.0f} s; "
                                       f"ranks {sorted(set(range(world_size)) - set(out))} still running "
                                       f"(likely a collective mismatch or deadlock)")
                try:
                    rank, status, value = results.get(timeout=min(remaining, 1.0))
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in out]
                    if dead:
                        raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                         f"before reporting a result")
                    continue
                if status == "error":
                    raise RankFailed(f"rank {rank} of {world_size} failed:\n{value}")
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=10 if len(out) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [out[r] for r in range(world_size)]
