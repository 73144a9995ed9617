"""Which DCP merge to use: the bytes each moves and the group's measured collective costs (issue 26).

A merge is a list of collectives per attention layer (`comm_stats.merge_collectives`:
the Q all-gather, then either the LSE all-gather + reduce-scatter of AG+RS or the one
all-to-all of A2A), each sending a known number of bytes. A collective of kind k
sending s bytes is modelled as `latency[k] + s * seconds_per_byte[k]`, with both
numbers measured on the group itself (`calibrate`: each kind at two message sizes,
the fastest of a few repetitions (load on a shared machine only adds time), the max over ranks so every rank holds the same
numbers and makes the same choice; cached per group). `choose` predicts every merge
for the graph's token count and picks the cheapest.

Why measure rather than count collectives: A2A moves fewer bytes and has one
collective fewer, but an all-to-all is not as well optimised as a ring all-gather on
every backend (NCCL / HCCL at large messages, gloo's pairwise exchange), so the per
byte and per call costs differ by kind and by machine.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from cp_compile.comm_stats import merge_collectives

MERGES = ("ag_rs", "a2a")
KINDS = ("all_gather", "reduce_scatter", "all_to_all")
# Message sizes of the calibration (bytes each rank sends): a small one for the latency,
# a large one for the bandwidth. Decode merges send KiB to a few MiB per layer.
SMALL_BYTES = 4 << 10
LARGE_BYTES = 1 << 20


@dataclass(frozen=True)
class CollectiveCosts:
    """Per collective kind: fixed cost (s) and cost per byte sent (s/B), on one group."""

    latency_s: dict[str, float]
    seconds_per_byte: dict[str, float]
    group_size: int
    backend: str

    def seconds(self, kind: str, sent_bytes: int) -> float:
        return self.latency_s[kind] + sent_bytes * self.seconds_per_byte[kind]

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MergeChoice:
    merge: str
    predicted_s: dict[str, float]  # merge -> predicted seconds per layer
    tokens: int
    reason: str

    def to_json(self) -> dict:
        return asdict(self)


def predict(costs: CollectiveCosts, merge: str, *, tokens: int, heads: int, q_dim: int, v_dim: int,
            dtype_bytes: int) -> float:
    """Predicted seconds per layer of `merge` (its Q all-gather included)."""
    return sum(costs.seconds(kind, sent) for kind, sent in
               merge_collectives(tokens, heads, q_dim, v_dim, dtype_bytes, costs.group_size, merge))


def choose(costs: CollectiveCosts | None, *, tokens: int, heads: int, q_dim: int, v_dim: int,
           dtype_bytes: int) -> MergeChoice:
    """The cheapest merge for a graph of `tokens` tokens. Without measured costs (a
    context built for a test, no `init_parallel`), AG+RS, the previous default, and the
    reason says so."""
    if costs is None:
        return MergeChoice("ag_rs", {}, tokens, "no calibrated collective costs (no init_parallel): ag_rs")
    pred = {m: predict(costs, m, tokens=tokens, heads=heads, q_dim=q_dim, v_dim=v_dim, dtype_bytes=dtype_bytes)
            for m in MERGES}
    best = min(MERGES, key=lambda m: pred[m])
    return MergeChoice(best, pred, tokens, f"cost model, {costs.backend} group of {costs.group_size}")


# torch 2.13 renamed the tensor collectives (`*_single`); older torch has only the old names.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _collective(kind: str, n: int, sent: int, group: dist.ProcessGroup, device: torch.device):
    """A callable issuing one collective of `kind` in which this rank sends ~`sent` bytes."""
    if kind == "all_gather":  # sends its input to n - 1 peers
        x = torch.zeros(max(sent // (4 * (n - 1)), 1), device=device)
        out = torch.empty(x.numel() * n, device=device)
        return lambda: _all_gather(out, x, group=group)
    per_peer = max(sent // (4 * (n - 1)), 1)  # reduce-scatter / all-to-all: input * (n-1)/n is sent
    x = torch.zeros(per_peer * n, device=device)
    if kind == "reduce_scatter":
        out = torch.empty(per_peer, device=device)
        return lambda: _reduce_scatter(out, x, group=group)
    out = torch.empty_like(x)
    return lambda: dist.all_to_all_single(out, x, group=group)


_CACHE: dict[tuple, CollectiveCosts] = {}


def calibrate(group: dist.ProcessGroup, device: torch.device, reps: int = 3) -> CollectiveCosts:
    """Measure every collective kind on `group` (collective: every rank of it calls this).
    Cached per (group ranks, backend); a second call returns the cached costs."""
    ranks = tuple(dist.get_process_group_ranks(group))
    backend = str(dist.get_backend(group))
    key = (ranks, backend, str(device))
    if key in _CACHE:
        return _CACHE[key]
    n = len(ranks)
    measured = []  # [kind][size] seconds
    for kind in KINDS:
        for sent in (SMALL_BYTES, LARGE_BYTES):
            call = _collective(kind, n, sent, group, device)
            call()  # warm-up (connection set-up, allocation)
            ts = []
            for _ in range(reps):
                dist.barrier(group=group)
                t0 = time.perf_counter()
                call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                ts.append(time.perf_counter() - t0)
            measured.append(min(ts))  # load only adds time: the fastest is the collective's own cost
    t = torch.tensor(measured, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # every rank: the same numbers, the same choice
    vals = t.tolist()
    lat, spb = {}, {}
    for i, kind in enumerate(KINDS):
        small, large = vals[2 * i], vals[2 * i + 1]
        spb[kind] = max(large - small, 0.0) / (LARGE_BYTES - SMALL_BYTES)
        lat[kind] = max(small - SMALL_BYTES * spb[kind], 0.0)
    costs = CollectiveCosts(lat, spb, n, backend)
    _CACHE[key] = costs
    return costs
