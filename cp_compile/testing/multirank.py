"""Run a function on N locally spawned gloo ranks and collect per-rank results.

Used by tests, examples and benchmarks. The rendezvous is a FileStore in a fresh
temporary directory, so back-to-back worlds never race for a TCP port.

Failures fail fast and name the rank that failed first:
- a rank that raises leaves a note (`failed_<rank>` in the world's directory)
  before its process exits; a rank the parent finds dead (killed, crashed) gets
  one from the parent;
- a rank that then fails because of it (its collective lost the peer, or timed
  out) waits briefly for such a note and appends "peer rank R failed first: ..."
  to its own traceback;
- the parent keeps collecting for `peer_grace` seconds after the first failure,
  so `RankFailed` reports the root failure first and how each peer ended (its
  error and how long after, or still running and killed). Nothing waits longer
  than that: ranks still running then are killed.
A world that does not finish within `timeout` seconds is killed and raises
`TimeoutError`.
"""

from __future__ import annotations

import glob
import io
import os
import queue as queue_mod
import signal
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from cp_compile.runtime.parallel_state import destroy_parallel

_NOTE_WAIT_S = 2.0  # how long a failing rank waits for a peer's failure note
_POLL_S = 0.2


class RankFailed(RuntimeError):
    """A spawned rank raised or died; the message carries its traceback.

    root: the rank that failed first (a dead rank, else the earliest rank whose error
    does not blame a peer); failures: rank -> traceback or death note; times: rank ->
    wall-clock time of its failure; killed: ranks still running after the grace
    period (killed by the harness).
    """

    def __init__(self, message: str, root: int, failures: dict[int, str], times: dict[int, float],
                 killed: list[int]) -> None:
        super().__init__(message)
        self.root = root
        self.failures = failures
        self.times = times
        self.killed = killed


def _note_path(world_dir: str, rank: int) -> str:
    return os.path.join(world_dir, f"failed_{rank}")


def _write_note(world_dir: str, rank: int, at: float, dead: bool, text: str) -> None:
    tmp = _note_path(world_dir, rank) + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{at!r}|{'dead' if dead else 'error'}|{text}")
    os.replace(tmp, _note_path(world_dir, rank))  # atomic: readers never see half a note


def _blamed_peers(world_dir: str, rank: int, failed_at: float) -> dict[int, str]:
    """Peers that failed before `failed_at`, or died (the parent notes deaths late)."""
    notes = {}
    for path in glob.glob(os.path.join(world_dir, "failed_*")):
        if path.endswith(".tmp"):
            continue
        r = int(path.rsplit("_", 1)[1])
        if r == rank:
            continue
        with open(path) as f:
            at, kind, text = f.read().split("|", 2)
        if kind == "dead" or float(at) < failed_at:
            notes[r] = text
    return notes


def _looks_collective(exc: BaseException) -> bool:
    """An error a lost or silent peer causes (gloo: connection closed / reset, timeout)."""
    import torch.distributed as dist

    msg = str(exc).lower()
    return isinstance(exc, dist.DistError) or any(
        k in msg for k in ("gloo", "connection", "timed out", "timeout", "nccl", "hccl", "broken pipe"))


def _summary(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _worker(fn: Callable[..., Any], rank: int, world_size: int, world_dir: str, threads: int,
            pg_timeout: float, args: tuple, kwargs: dict, results: Any) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    try:
        store = dist.FileStore(os.path.join(world_dir, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        out = fn(rank, world_size, *args, **kwargs)
        # Serialise here: tensors sent through the queue by shared memory would need
        # this process alive until the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, "ok", buf.getvalue(), time.time()))
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        failed_at = time.time()
        tb = traceback.format_exc()
        _write_note(world_dir, rank, failed_at, False, _summary(exc))
        # Only an error a lost peer can cause blames a peer; any other is this rank's own.
        collective = _looks_collective(exc)
        peers = _blamed_peers(world_dir, rank, failed_at) if collective else {}
        if not peers and collective:
            # Likely the echo of a peer's failure: give that peer (or the parent, for a
            # dead one) a moment to leave its note. Own errors do not wait.
            deadline = time.monotonic() + _NOTE_WAIT_S
            while not peers and time.monotonic() < deadline:
                time.sleep(0.05)
                peers = _blamed_peers(world_dir, rank, failed_at)
        tb += "".join(f"(peer rank {r} failed first: {note})\n" for r, note in sorted(peers.items()))
        results.put((rank, "error", tb, failed_at))
    finally:
        try:
            destroy_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown must not mask the result
            pass


def _death_note(code: int) -> str:
    if code < 0:
        try:
            return f"died with exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"died with exit code {code}"


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0,
                 threads_per_rank: int = 1, peer_grace: float = 10.0, pg_timeout: float | None = None,
                 **kwargs: Any) -> list[Any]:
    """Call `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks.

    `fn` must be importable (module level) and its arguments and result picklable.
    torch.distributed is initialised before `fn` runs (default-group collective
    timeout `pg_timeout`, default `timeout` + 60 s so the harness's own timeout
    fires first); `fn` typically calls `cp_compile.init_parallel(cfg)`. Returns the
    results ordered by rank. A failure raises `RankFailed` (see the module doc).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    pg_timeout = timeout + 60.0 if pg_timeout is None else pg_timeout
    with tempfile.TemporaryDirectory(prefix="cp_ranks_") as world_dir:
        procs = [ctx.Process(target=_worker, daemon=True,
                             args=(fn, r, world_size, world_dir, threads_per_rank, pg_timeout, args, kwargs,
                                   results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        out: dict[int, Any] = {}
        failures: dict[int, str] = {}
        times: dict[int, float] = {}
        dead: set[int] = set()
        first_failure: float | None = None
        deadline = time.monotonic() + timeout
        try:
            while len(out) + len(failures) < world_size:
                now = time.monotonic()
                if first_failure is not None and now - first_failure > peer_grace:
                    break
                if now >= deadline:
                    if failures:
                        break
                    raise TimeoutError(f"{world_size}-rank world did not finish in {timeout:.0f} s; "
                                       f"ranks {sorted(set(range(world_size)) - set(out))} still running "
                                       f"(likely a collective mismatch or deadlock)")
                try:
                    rank, status, value, at = results.get(timeout=min(deadline - now, _POLL_S))
                except queue_mod.Empty:
                    for r, p in enumerate(procs):
                        # Exit code 0 without a result: the result is still in the queue.
                        if p.exitcode not in (None, 0) and r not in out and r not in failures:
                            note = _death_note(p.exitcode)
                            _write_note(world_dir, r, time.time(), True, note)  # lets the survivors name it
                            failures[r], times[r] = f"rank {r} {note} before reporting a result", time.time()
                            dead.add(r)
                            first_failure = first_failure if first_failure is not None else time.monotonic()
                    continue
                if status == "error":
                    failures[rank], times[rank] = value, at
                    first_failure = first_failure if first_failure is not None else time.monotonic()
                else:
                    out[rank] = torch.load(io.BytesIO(value), weights_only=False)
        finally:
            for p in procs:
                p.join(timeout=10 if len(out) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    if failures:
        killed = sorted(set(range(world_size)) - set(out) - set(failures))
        raise _rank_failed(world_size, failures, times, dead, killed, peer_grace)
    return [out[r] for r in range(world_size)]


def _rank_failed(world_size: int, failures: dict[int, str], times: dict[int, float], dead: set[int],
                 killed: list[int], peer_grace: float) -> RankFailed:
    # The root: a dead rank (its peers' errors are echoes), else the earliest error
    # that does not blame a peer, else the earliest error.
    own = [r for r in failures if "(peer rank " not in failures[r]]
    pool = sorted(dead) or sorted(own, key=lambda r: times[r]) or sorted(failures, key=lambda r: times[r])
    root = pool[0]
    parts = [failures[root] if root in dead else f"rank {root} of {world_size} failed:\n{failures[root]}"]
    for r in sorted(failures, key=lambda r: times[r]):
        if r != root:
            parts.append(f"then rank {r} failed {times[r] - times[root]:+.2f} s after rank {root}:\n{failures[r]}")
    for r in killed:
        parts.append(f"rank {r} was still running {peer_grace:.0f} s after the first failure; killed")
    return RankFailed("\n".join(parts), root, failures, times, killed)
