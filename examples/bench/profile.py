"""Where a step's time goes, from the torch profiler on every rank.

Each profiled step is one `bench::step:<side>` region; inside it the outermost events are
put in buckets by name (an op inside a bucketed op counts for its parent only):

- `attention`: the attention ops (`cp::gqa_paged_attention`, `cp::mla_attention`,
  their DCP partials `cp::paged_attention_lse` / `cp::mla_partial_attention`, and
  `cp::cache_write`, which the single-device ops do inside; SFA's indexer and sparse
  attention, single-device and partial; chunked prefill's causal part);
- `dcp_local`: DCP's own local work (`cp::dcp_localize_metadata`, `cp::lse_rescale`,
  `cp::lse_combine`, SFA's top-k remap `cp::dcp_sparse_indices`);
- `dcp_comm`: DCP collectives (all-gather, reduce-scatter, all-to-all), issue + wait;
- `tp_comm`: TP all-reduces, issue + wait;
- `other`: the rest of the step (projections, MLP, norms, rope, Python, launch);
  `other_ops` lists its largest ops by self time, so the rest has names.

A `_c10d_functional::wait_tensor` is charged to the collective it waits for (the
oldest one not yet waited on, in issue order). On gloo a wait also holds the time
the other rank needed to reach the collective, i.e. load imbalance shows up as comm.
"""

from __future__ import annotations

import statistics
from collections import deque
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from cp_compile.ops.core.catalog import profile_buckets

CATEGORIES = ("attention", "dcp_local", "dcp_comm", "tp_comm", "other")
STEP = "bench::step"
# Each op's bucket is declared with the op (OpDecl.profile, ops/core/spec.py).
ATTENTION_OPS = {op for op, bucket in profile_buckets().items() if bucket == "attention"}
DCP_LOCAL_OPS = {op for op, bucket in profile_buckets().items() if bucket == "dcp_local"}
_COLL = "_c10d_functional::"
OTHER_TOP = 8  # ops of `other` listed by self time (the profile's answer to "what is the rest")


def _collective_kind(name: str) -> str | None:
    """'dcp' / 'tp' for a collective's issue op, None otherwise."""
    if not name.startswith(_COLL) or "wait_tensor" in name:
        return None
    if "all_reduce" in name:
        return "tp"
    if any(k in name for k in ("all_gather", "reduce_scatter", "all_to_all")):
        return "dcp"
    return None


def _bucket(name: str) -> str | None:
    if name in ATTENTION_OPS:
        return "attention"
    if name in DCP_LOCAL_OPS:
        return "dcp_local"
    return None


def step_breakdown(step: Any, events: list[Any]) -> dict[str, float]:
    """ms per category (and collective counts) of one `bench::step` event."""
    t0, t1 = step.time_range.start, step.time_range.end
    inside = sorted((e for e in events if e.thread == step.thread and e is not step
                     and t0 <= e.time_range.start and e.time_range.end <= t1),
                    key=lambda e: (e.time_range.start, -e.time_range.end))
    out = dict.fromkeys(CATEGORIES, 0.0)
    other_ops: dict[str, float] = {}  # self time (ms) of each op outside the buckets: what `other` is
    counts = {"dcp": 0, "tp": 0}
    pending: deque[str] = deque()
    covered_until = t0  # end of the last bucketed event: anything starting before it is nested
    for e in inside:
        s, t = e.time_range.start, e.time_range.end
        if s < covered_until:
            continue
        kind = _collective_kind(e.name)
        if kind is not None:
            counts[kind] += 1
            pending.append(kind)
            cat = f"{kind}_comm"
        elif e.name.startswith(_COLL) and "wait_tensor" in e.name:
            cat = f"{pending.popleft()}_comm" if pending else "other"
        else:
            cat = _bucket(e.name)
        if cat is None:
            other_ops[e.name] = other_ops.get(e.name, 0.0) + e.self_cpu_time_total / 1e3
            continue
        out[cat] += (t - s) / 1e3
        covered_until = t
    total = (t1 - t0) / 1e3
    out["other"] += max(total - sum(out.values()), 0.0)
    top = dict(sorted(other_ops.items(), key=lambda kv: -kv[1])[:OTHER_TOP])
    return dict(step=total, **out, dcp_collectives=counts["dcp"], tp_collectives=counts["tp"], other_ops=top)


@contextmanager
def profiling(enabled: bool) -> Iterator[Any]:
    """A CPU (and CUDA when present) profiler, or nothing."""
    if not enabled:
        yield None
        return
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        yield prof


def breakdown(prof: Any, label: str = STEP) -> list[dict[str, float]]:
    """One dict per profiled step (events named `label`), in order."""
    events = list(prof.events())
    steps = sorted((e for e in events if e.name == label), key=lambda e: e.time_range.start)
    return [step_breakdown(s, events) for s in steps]


def median_breakdown(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over steps of each field (the step's own median, not the sum of medians);
    `other_ops`: the median over steps of each listed op's self time (0 where absent)."""
    if not steps:
        return {}
    out: dict[str, Any] = {k: statistics.median(s[k] for s in steps) for k in steps[0] if k != "other_ops"}
    names = {n for s in steps for n in s.get("other_ops", {})}
    ops = {n: statistics.median(s.get("other_ops", {}).get(n, 0.0) for s in steps) for n in names}
    out["other_ops"] = dict(sorted(ops.items(), key=lambda kv: -kv[1])[:OTHER_TOP])
    return out
