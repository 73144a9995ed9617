"""The merge-choice table: predicted vs measured cost of each DCP merge, and what `auto` picks (issue 26).

    .venv/bin/python -m examples.bench.merge_choice                    # 2 gloo ranks, batch 1, 8, 64
    .venv/bin/python -m examples.bench.merge_choice --batch 1,8,64 --rounds 7

On `--dcp` spawned gloo ranks (one DCP group), `init_parallel` with dcp_merge="auto"
measures the group's collective costs (`merge_cost.calibrate`); then, per batch (decode:
T = batch tokens) at the real per-rank GQA shape (Qwen3-235B at tp 8: 8 query heads of
128 per rank, fp32), each merge's collectives of one layer run for real: the Q
all-gather and `ops.parallel.dcp.merge_heads` (AG+RS: LSE all-gather, rescale,
reduce-scatter; A2A: one all-to-all of [out | lse], combine; replicate (query
replication, decision 49): no Q all-gather, the N - 1 other ranks' query projections
`x [T, hidden] @ W_q^T` (hidden `--hidden`, 4096 for Qwen3-235B) + the all-to-all),
the merges interleaved (order rotated / reversed per round) over `--rounds` rounds,
each round `--layers` layers back to back between barriers, the max over ranks.
Measured: ms per layer, median (min–max) over rounds (the query projection every
merge runs once is left out of all three). Predicted: `merge_cost.predict` per layer
with the calibrated costs. `chosen`: `merge_cost.choose`, which the DCP pass uses per
compiled graph. `auto / best`: measured time of the chosen merge over the fastest
measured one, per round; `within spread`: the chosen merge's median is at most the
max of the merge with the best median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import cp_compile
from cp_compile.base import merge_cost
from cp_compile.ops.parallel.dcp import DCPContext, all_gather_heads, merge_heads
from cp_compile.testing.multirank import run_on_ranks
from examples.bench.attention_bandwidth import commit


def _world(rank: int, world: int, batches: list[int], heads: int, dim: int, rounds: int, layers: int,
           hidden: int) -> dict:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=world, block_size=16)
    state = cp_compile.init_parallel(cfg, device="cpu")
    costs = state.collective_costs
    assert costs is not None
    out = {"costs": costs.to_json(), "rows": []}
    # The per-rank query projection (Qwen3: q_proj [H*D, hidden] + q_norm [D]), one copy per other rank.
    g = torch.Generator().manual_seed(100 + rank)
    w_q = [torch.randn(heads * dim, hidden, generator=g) * hidden ** -0.5 for _ in range(world - 1)]
    qw = merge_cost.QueryWeights(bytes=4 * (heads * dim * hidden + dim), matrix_elements=heads * dim * hidden)
    for T in batches:
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(T, heads, dim, generator=g)
        x = torch.randn(T, hidden, generator=g)
        part = torch.randn(T, world * heads, dim, generator=g)
        lse = torch.randn(T, world * heads, generator=g)
        ctxs = {m: DCPContext(group=state.layout.cp, interleave=1, block_size=16, merge=m) for m in merge_cost.MERGES}

        def layer(m: str) -> None:
            if m == "replicate":
                for w in w_q:
                    torch.nn.functional.linear(x, w)
            else:
                all_gather_heads(q, ctxs[m])
            merge_heads(part, lse, ctxs[m], heads, torch.float32)

        for m in merge_cost.MERGES:  # warm-up
            layer(m)
        ms: dict[str, list[float]] = {m: [] for m in merge_cost.MERGES}
        k = len(merge_cost.MERGES)
        for r in range(rounds):
            order = merge_cost.MERGES[r % k:] + merge_cost.MERGES[:r % k]
            for m in (order if r % 2 == 0 else order[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(layers):
                    layer(m)
                t = torch.tensor([(time.perf_counter() - t0) * 1e3 / layers], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                ms[m].append(t.item())
        sizes = dict(tokens=T, heads=heads, q_dim=dim, v_dim=dim, dtype_bytes=4)
        choice = merge_cost.choose(costs, **sizes, query_weights=qw)
        best = [min(ms[m][r] for m in ms) for r in range(rounds)]
        med = {m: statistics.median(v) for m, v in ms.items()}
        best_m = min(med, key=med.get)
        out["rows"].append({
            "batch": T, "chosen": choice.merge, "decision": choice.to_json(), "best_measured": best_m,
            "within_spread": med[choice.merge] <= max(ms[best_m]),
            "predicted_ms": {m: 1e3 * s for m, s in choice.predicted_s.items()},
            "measured_ms": {m: {"median": med[m], "min": min(v), "max": max(v)} for m, v in ms.items()},
            "auto_regret": {"median": statistics.median(ms[choice.merge][r] / best[r] for r in range(rounds)),
                            "max": max(ms[choice.merge][r] / best[r] for r in range(rounds))}})
    cp_compile.destroy_parallel()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096, help="the query projection's input size (replicate)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--out", default="results/merge_choice")
    a = ap.parse_args(argv)
    load0 = os.getloadavg()[0]
    res = run_on_ranks(_world, a.dcp, [int(b) for b in a.batch.split(",")], a.heads, a.head_dim, a.rounds,
                       a.layers, a.hidden, timeout=900)[0]
    meta = {"commit": commit(), "load_avg_start": load0, "load_avg_end": os.getloadavg()[0], "dcp": a.dcp,
            "rounds": a.rounds, "layers": a.layers, "heads": a.heads, "head_dim": a.head_dim, "hidden": a.hidden}
    print(f"commit {meta['commit']}, load average {load0:.1f} -> {meta['load_avg_end']:.1f}, dcp {a.dcp} gloo ranks, "
          f"{a.rounds} rounds (rotated order) x {a.layers} layers, {a.heads} heads x {a.head_dim} per rank, "
          f"hidden {a.hidden}, fp32")
    c = res["costs"]
    print("calibrated (latency ms, ns/B): " + ", ".join(
        f"{k} {1e3 * c['latency_s'][k]:.3f} / {1e9 * c['seconds_per_byte'][k]:.2f}" for k in merge_cost.KINDS)
        + f"; matmul {1e9 * c['matmul_s_per_weight_byte']:.3f} ns/weight B, {1e12 * c['matmul_s_per_flop']:.1f} ps/flop")
    head = " | ".join(f"{m} predicted | {m} measured" for m in merge_cost.MERGES)
    print(f"| batch | {head} | chosen | best (median) | auto / best | within spread |")
    print("|---:|" + "---:|" * (2 * len(merge_cost.MERGES)) + "---|---|---:|---|")
    for r in res["rows"]:
        cells = []
        for m in merge_cost.MERGES:
            s = r["measured_ms"][m]
            cells += [f"{r['predicted_ms'][m]:.2f}", f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"]
        print(f"| {r['batch']} | " + " | ".join(cells) + f" | {r['chosen']} | {r['best_measured']} | "
              f"{r['auto_regret']['median']:.2f} (max {r['auto_regret']['max']:.2f}) | "
              f"{'yes' if r['within_spread'] else 'no'} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "merge_choice.json").write_text(json.dumps({"meta": meta, **res}, indent=1))


if __name__ == "__main__":
    main()
