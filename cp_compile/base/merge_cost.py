"""Which DCP merge to use: the bytes each moves and the group's measured collective costs (issue 26).

A merge is a list of collectives per attention layer (`comm_stats.merge_collectives`:
the Q all-gather, then either the LSE all-gather + reduce-scatter of AG+RS or the one
all-to-all of A2A), each sending a known number of bytes. A collective of kind k
sending s bytes is modelled as `latency[k] + s * seconds_per_byte[k]`, with both
numbers measured on the group itself (`calibrate`: each kind at two message sizes,
the fastest of a few repetitions (load on a shared machine only adds time), the max over ranks so every rank holds the same
numbers and makes the same choice; cached per group). `choose` predicts every merge
for the graph's token count and picks the cheapest.

Query replication ("replicate", decision 49) drops the Q all-gather but every rank
computes the queries of all N ranks of its group: N - 1 more query projections per
layer. Their cost is modelled from the projection's parameters (`QueryWeights`: bytes
read, matrix elements for the flops) as `bytes * s/B + 2 * T * elements * s/flop`, the
two numbers measured by `calibrate` on two matmuls (one row against a 32 MiB weight:
the read; 64 rows against a 4 MiB one: the flops). A graph whose
query projection cannot be replicated (passes/query_replication.py) has no
`QueryWeights` and `choose` leaves replicate out.

Project before the merge (issue 37, decision 61): the merge is linear in each rank's
partial (`out = sum_r w_r * out_r`), so a per-head linear map that follows the attention
(MLA's W_UV, latent L -> V head dim Dv) can be applied to every partial before the merge:
the merge then moves Dv columns per head instead of L (MLA: 128 against 512), and each
rank projects the group's N * H heads instead of its H (`ProjectionWeights`: N - 1 more
W_UV products per layer, the other ranks' W_UV gathered at compile time). Each merge is
a candidate with and without it (`candidates`); "auto" picks the cheapest pair.

The all-reduce fold (issue 37, decision 62): the merge is linear and so is the row-parallel
o_proj after it, whose TP all-reduce sums over heads anyway; each rank rescales its partial
of the group's N * H heads, multiplies it by those heads' o_proj columns (`FoldWeights`:
gathered at compile time, N - 1 more o_proj products per layer) and the TP all-reduce sums
the group's ranks too. The candidate "<merge>+fold" keeps the Q all-gather (or replication)
and the LSE all-gather and drops the output collective. Under "auto" it is left out where the
gathered o_proj columns exceed `FOLD_KV_FRACTION` of the graph's KV cache bytes.

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

from cp_compile.base.comm_stats import merge_collectives

MERGES = ("ag_rs", "a2a", "replicate")
# dcp_project_before_merge: "auto" (the cost model decides with the merge), "on" (wherever
# provable; an explicit "on" that is not provable is a ConfigError), "off".
PROJECT = ("auto", "on", "off")
PROJECTED = "+project"  # the candidate name suffix: "a2a+project"
FOLDED = "+fold"  # the all-reduce fold's suffix: "ag_rs+fold" (MLA: "ag_rs+project+fold")
# dcp_merge_fold="auto" takes the fold only where the o_proj columns it gathers (all layers) are at
# most this fraction of the KV cache bytes the graph holds: that memory would otherwise hold KV blocks.
FOLD_KV_FRACTION = 0.05
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
    # A matmul on this device: seconds per weight byte read and per flop (the replicated
    # query projections of "replicate"); 0 where not measured.
    matmul_s_per_weight_byte: float = 0.0
    matmul_s_per_flop: float = 0.0

    def seconds(self, kind: str, sent_bytes: int) -> float:
        return self.latency_s[kind] + sent_bytes * self.seconds_per_byte[kind]

    def matmul_seconds(self, weight_bytes: int, flops: int) -> float:
        return weight_bytes * self.matmul_s_per_weight_byte + flops * self.matmul_s_per_flop

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class QueryWeights:
    """One rank's query projection of one layer: the parameters "replicate" runs N - 1
    more times. bytes: all of them (read once per run); matrix_elements: elements of the
    2-D ones (2 * T * elements flops per run)."""

    bytes: int
    matrix_elements: int


@dataclass(frozen=True)
class ProjectionWeights:
    """One rank's per-head output projection of one layer (MLA: W_UV [H, L, Dv]) that
    project-before-merge applies to the group's N * H heads (N - 1 more runs of it per
    layer). bytes: this rank's (its H heads); matrix_elements: H * L * Dv (2 * T *
    elements flops per run); out_dim: Dv, the head dim the merge then moves."""

    bytes: int
    matrix_elements: int
    out_dim: int


@dataclass(frozen=True)
class FoldWeights:
    """One rank's row-parallel o_proj of one layer, which the all-reduce fold applies to the
    group's N * H heads (decision 62). bytes / matrix_elements: this rank's shard
    [hidden, H * Dv] (N - 1 more products per layer, 2 * T * elements flops each);
    extra_bytes: the other group ranks' columns it holds, all layers; kv_bytes: the KV cache
    bytes the graph holds on this rank (what "auto" weighs extra_bytes against);
    projection: MLA's W_UV (the fold projects the group's heads first), None for GQA."""

    bytes: int
    matrix_elements: int
    extra_bytes: int
    kv_bytes: int
    projection: ProjectionWeights | None = None

    @property
    def kv_fraction(self) -> float:
        return self.extra_bytes / self.kv_bytes if self.kv_bytes else float("inf")


def candidate(merge: str, project: bool, fold: bool = False) -> str:
    """The name of a (merge, project, fold) candidate: "a2a", "a2a+project", "ag_rs+fold", ..."""
    return merge + (PROJECTED if project else "") + (FOLDED if fold else "")


def split_candidate(name: str) -> tuple[str, bool]:
    """(merge, project) of a candidate name (a "+fold" suffix dropped: `is_fold`)."""
    if name.endswith(FOLDED):
        name = name[: -len(FOLDED)]
    return (name[: -len(PROJECTED)], True) if name.endswith(PROJECTED) else (name, False)


def is_fold(name: str) -> bool:
    return name.endswith(FOLDED)


@dataclass(frozen=True)
class MergeChoice:
    merge: str
    predicted_s: dict[str, float]  # candidate ("a2a", "a2a+project", ...) -> predicted seconds per layer
    tokens: int
    reason: str
    project: bool = False  # project before the merge (issue 37)
    fold: bool = False  # the all-reduce fold (decision 62): no output collective, o_proj on the group's heads

    def to_json(self) -> dict:
        return asdict(self)


def predict(costs: CollectiveCosts, merge: str, *, tokens: int, heads: int, q_dim: int, v_dim: int,
            dtype_bytes: int, query_weights: QueryWeights | None = None,
            projection: ProjectionWeights | None = None, fold: FoldWeights | None = None) -> float:
    """Predicted seconds per layer of `merge` (its Q all-gather included; for "replicate"
    the N - 1 extra query projections, which need `query_weights`). With `projection`
    (project before the merge): the merge moves `projection.out_dim` columns per head and
    each rank runs the projection N - 1 more times (the group's heads, not its own)."""
    merged_dim = v_dim if projection is None else projection.out_dim
    sec = sum(costs.seconds(kind, sent) for kind, sent in
              merge_collectives(tokens, heads, q_dim, merged_dim, dtype_bytes, costs.group_size, merge,
                                fold=fold is not None))
    if fold is not None:  # (N - 1) more o_proj products per layer (the group's heads' columns)
        sec += (costs.group_size - 1) * costs.matmul_seconds(fold.bytes, 2 * tokens * fold.matrix_elements)
    if merge == "replicate":
        if query_weights is None:
            raise ValueError("predict('replicate') needs query_weights (the query projection's parameters)")
        sec += (costs.group_size - 1) * costs.matmul_seconds(query_weights.bytes,
                                                              2 * tokens * query_weights.matrix_elements)
    if projection is not None:
        sec += (costs.group_size - 1) * costs.matmul_seconds(projection.bytes, 2 * tokens * projection.matrix_elements)
    return sec


def candidates(merge: str = "auto", project: str = "auto", *, replicable: bool = True,
               projectable: bool = False) -> tuple[tuple[str, bool], ...]:
    """The (merge, project) pairs the config allows: `merge` / `project` explicit or "auto";
    replicate only where the query chain is `replicable`, projection only where `projectable`."""
    merges = MERGES if merge == "auto" else (merge,)
    if not replicable:
        merges = tuple(m for m in merges if m != "replicate")
    projects = {"auto": (False, True), "on": (True,), "off": (False,)}[project]
    if not projectable:
        projects = tuple(p for p in projects if not p) or (False,)
    return tuple((m, p) for m in merges for p in projects)


def fold_candidates(merge: str = "auto", fold: str = "off", *, replicable: bool = True,
                    weights: FoldWeights | None = None) -> tuple[tuple[tuple[str, bool], ...], str | None]:
    """The (merge, project) pairs the all-reduce fold adds, and why none where it adds none.
    One Q source per kind: "ag_rs" stands for the gathered queries (a2a's fold graph is the
    same), "replicate" where replicable; MLA's fold projects by W_UV (project True)."""
    if fold == "off":
        return (), None
    if weights is None:
        return (), "the all-reduce fold not provable"
    if fold == "auto" and weights.kv_fraction > FOLD_KV_FRACTION:
        return (), (f"the all-reduce fold left out: its gathered o_proj columns ({weights.extra_bytes} bytes) are "
                    f"{weights.kv_fraction:.3f} of the KV cache bytes ({weights.kv_bytes}), above FOLD_KV_FRACTION "
                    f"{FOLD_KV_FRACTION} (dcp_merge_fold='on' takes it)")
    merges = ("ag_rs", "replicate") if merge == "auto" else ("ag_rs" if merge == "a2a" else merge,)
    if not replicable:
        merges = tuple(m for m in merges if m != "replicate")
    return tuple((m, weights.projection is not None) for m in merges), None


def choose(costs: CollectiveCosts | None, *, tokens: int, heads: int, q_dim: int, v_dim: int,
           dtype_bytes: int, query_weights: QueryWeights | None = None,
           projection: ProjectionWeights | None = None, merge: str = "auto", project: str = "auto",
           fold: str = "off", fold_weights: FoldWeights | None = None) -> MergeChoice:
    """The cheapest candidate for a graph of `tokens` tokens: AG+RS, A2A and, where the
    graph's query projection can be replicated (`query_weights` given), replicate; each
    with and without projecting before the merge where the graph's output projection
    allows it (`projection` given). `merge` / `project` explicit narrow the candidates.
    Without measured costs (a context built for a test, no `init_parallel`), AG+RS (or the
    explicit merge), not projected unless `project="on"`, and the reason says so."""
    folds, no_fold = fold_candidates(merge, fold, replicable=query_weights is not None, weights=fold_weights)
    if costs is None or fold == "on" and folds:
        m = "ag_rs" if merge == "auto" else merge
        p = project == "on" and projection is not None
        if fold == "on" and folds:  # asked for: the fold, on the first Q source it allows
            (m, p), f = folds[0], True
            pred = {} if costs is None else {candidate(m, p, f): predict(
                costs, m, tokens=tokens, heads=heads, q_dim=q_dim, v_dim=v_dim, dtype_bytes=dtype_bytes,
                query_weights=query_weights, projection=fold_weights.projection, fold=fold_weights)}
            return MergeChoice(m, pred, tokens, f"dcp_merge_fold='on': {candidate(m, p, f)}", p, True)
        return MergeChoice(m, {}, tokens, f"no calibrated collective costs (no init_parallel): {candidate(m, p)}", p)
    cands = candidates(merge, project, replicable=query_weights is not None, projectable=projection is not None)
    pred = {candidate(m, p): predict(costs, m, tokens=tokens, heads=heads, q_dim=q_dim, v_dim=v_dim,
                                     dtype_bytes=dtype_bytes, query_weights=query_weights,
                                     projection=projection if p else None) for m, p in cands}
    for m, p in folds:
        pred[candidate(m, p, True)] = predict(costs, m, tokens=tokens, heads=heads, q_dim=q_dim, v_dim=v_dim,
                                              dtype_bytes=dtype_bytes, query_weights=query_weights,
                                              projection=fold_weights.projection, fold=fold_weights)
    best = min(pred, key=lambda c: pred[c])
    why = "" if no_fold is None or fold == "off" else f"; {no_fold}"
    if merge == "auto" and query_weights is None:
        why += "; replicate not a candidate (query projection not replicable)"
    if project == "auto" and projection is None:
        why += "; project-before-merge not a candidate"
    m, p = split_candidate(best)
    return MergeChoice(m, pred, tokens, f"cost model, {costs.backend} group of {costs.group_size}{why}", p,
                       is_fold(best))


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


class GroupCollectives:
    """The collectives a pass may issue while compiling, on the cache's cp group (query
    replication gathers the query projection's parameters, decision 48). Handed to the
    passes in the compile context (`CompileContext.cp_collectives`, from the parallel
    state), so no pass reads a process group of its own."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group: dist.ProcessGroup | None = group
        self.size = dist.get_world_size(group)
        # The device the group was built for (the parallel state's): NCCL / HCCL groups refuse host tensors.
        self.device = device

    def __getstate__(self) -> dict:  # a live group does not cross processes (a context sent back by a rank)
        return {"group": None, "size": self.size, "device": self.device}

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape on every rank), in group rank order."""
        t = t.detach().contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return parts

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """`t` reduced over the group ("max" or "min"), in place and returned."""
        dist.all_reduce(t, op={"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op], group=self.group)
        return t


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
    measured += _matmul_times(device, reps)
    t = torch.tensor(measured, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)  # every rank: the same numbers, the same choice
    vals = t.tolist()
    lat, spb = {}, {}
    for i, kind in enumerate(KINDS):
        small, large = vals[2 * i], vals[2 * i + 1]
        spb[kind] = max(large - small, 0.0) / (LARGE_BYTES - SMALL_BYTES)
        lat[kind] = max(small - SMALL_BYTES * spb[kind], 0.0)
    per_byte, per_flop = _matmul_costs(vals[2 * len(KINDS)], vals[2 * len(KINDS) + 1])
    costs = CollectiveCosts(lat, spb, n, backend, per_byte, per_flop)
    _CACHE[key] = costs
    return costs


# The matmuls of the calibration, fp32 [rows, in] x [in, out]^T: one row against a weight
# larger than a CPU's last-level cache (the weight read, as a decode query projection of
# 16+ MiB per layer streams it), and 64 rows against a small weight (the flops).
MATMUL_SHAPES = ((1, 4096, 2048), (64, 1024, 1024))


def _matmul_bytes_flops(rows: int, k: int, m: int) -> tuple[int, int]:
    return 4 * k * m, 2 * rows * k * m


def _matmul_costs(t_read: float, t_flops: float) -> tuple[float, float]:
    """(s per weight byte, s per flop) from the two calibration times: t = bytes * a + flops * b."""
    (b1, f1), (b2, f2) = (_matmul_bytes_flops(*s) for s in MATMUL_SHAPES)
    det = b1 * f2 - b2 * f1
    per_byte = (t_read * f2 - t_flops * f1) / det
    per_flop = (b1 * t_flops - b2 * t_read) / det
    if per_byte < 0:  # the small weight's reads dominated: all flops
        per_byte, per_flop = 0.0, t_flops / f2
    if per_flop < 0:
        per_byte, per_flop = t_read / b1, 0.0
    return per_byte, per_flop


def _matmul_times(device: torch.device, reps: int) -> list[float]:
    """Fastest of `reps` (x 3 back to back) of each calibration matmul, seconds per matmul."""
    out = []
    for rows, k, m in MATMUL_SHAPES:
        w = torch.randn(m, k, device=device)
        x = torch.randn(rows, k, device=device)
        torch.nn.functional.linear(x, w)  # warm-up
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(3):
                torch.nn.functional.linear(x, w)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            ts.append((time.perf_counter() - t0) / 3)
        out.append(min(ts))
    return out
