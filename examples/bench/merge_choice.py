"""The merge-choice table: predicted vs measured cost of each DCP merge candidate, and what `auto` picks
(issues 26, 37).

    .venv/bin/python -m examples.bench.merge_choice                        # GQA (Qwen3-235B), batch 1, 8, 64
    .venv/bin/python -m examples.bench.merge_choice --model mla            # MLA (DeepSeek-R1), with projection
    .venv/bin/python -m examples.bench.merge_choice --fold                 # + o_proj, and the all-reduce fold

On `--dcp` spawned gloo ranks (one DCP group), `init_parallel` with dcp_merge="auto"
measures the group's collective costs (`merge_cost.calibrate`); then, per batch (decode:
T = batch tokens) at a real per-rank shape (`SHAPES`: Qwen3-235B at tp 8, 8 query heads
of 128; DeepSeek-R1 at tp 8, 16 heads, latent 512 + rope 64, V head dim 128; fp32),
each candidate's work of one layer runs for real: the Q all-gather and
`ops.parallel.dcp.merge_heads` (AG+RS: LSE all-gather, rescale, reduce-scatter; A2A: one
all-to-all of [out | lse], combine; replicate (decision 49): no Q all-gather, the N - 1
other ranks' query projections `x [T, hidden] @ W_q^T` + the all-to-all). MLA adds W_UV:
after the merge on this rank's H heads, or, for "+project" (issue 37, decision 61),
before it on the group's N*H heads, so the merge moves [T, H, 128] instead of
[T, H, 512]. Candidates interleave (order rotated / reversed per round) over `--rounds`
rounds, each round `--layers` layers back to back between barriers, the max over ranks.
Measured: ms per layer, median (min–max) over rounds (the query projection every merge
runs once is left out). Collectives and bytes: one layer of each candidate under
`CollectiveMeter` (counted at dispatch, the bytes this rank sends), next to
`comm_stats.merge_collectives` (the formula); per step = per layer x the model's layers
(in the JSON). Predicted: `merge_cost.predict` with the calibrated costs. `chosen`:
`merge_cost.choose`, which the DCP pass uses per compiled graph. `auto / fastest`:
measured time of the chosen candidate over the fastest one, per round; `within spread`:
the chosen candidate's median is at most the max of the one with the best median.

`--fold` (issue 37, decision 62): every candidate's layer also runs this rank's o_proj
(`[T, H*Dv] @ W_o^T`, W_o `[model hidden, H*Dv]`), and the "+fold" candidates run instead the
LSE all-gather, `cp::lse_rescale` on the group's N*H heads (MLA: W_UV on them) and the o_proj of
the group's heads (`[model hidden, N*H*Dv]`); the TP all-reduce after o_proj, the same bytes for
every candidate, is left out (folded, it carries the merge). "auto" weighs the fold's gathered
weights (all layers, fp32) against `--kv-gib` GiB of KV cache per rank (`FOLD_KV_FRACTION`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

import cp_compile
from cp_compile.base import merge_cost
from cp_compile.base.comm_stats import CollectiveMeter, merge_collectives
from cp_compile.ops.parallel.dcp import DCPContext, Partial, all_gather_heads, merge_heads, rescale_partial
from cp_compile.testing.multirank import run_on_ranks
from examples.bench.attention_bandwidth import commit


@dataclass(frozen=True)
class Shape:
    """One rank's attention at a model's per-rank shape. q_dim: the gathered query's head dim
    (MLA: L + R, one fused all-gather); v_dim: the partial's (MLA: the latent L); out_dim: after
    the per-head output projection (MLA's W_UV: Dv; GQA: none, None); hidden: the query
    projection's input (replicate's N - 1 copies)."""

    name: str
    heads: int
    q_dim: int
    v_dim: int
    out_dim: int | None
    hidden: int
    layers: int  # the model's layers (per-step figures = per layer x layers)
    model_hidden: int = 4096  # o_proj's output (the residual stream)


SHAPES = {
    # Qwen3-235B at tp 8: 64 q heads / 8, head dim 128, hidden 4096, 94 layers.
    "gqa": Shape("Qwen3-235B tp8 per rank", 8, 128, 128, None, 4096, 94, 4096),
    # DeepSeek-R1 at tp 8: 128 heads / 8, latent 512 + rope 64, V head dim 128, q_lora 1536, 61 layers.
    "mla": Shape("DeepSeek-R1 tp8 per rank", 16, 576, 512, 128, 1536, 61, 7168),
}


def _world(rank: int, world: int, batches: list[int], shape: Shape, rounds: int, layers: int, fold: bool = False,
           kv_bytes: int = 32 << 30) -> dict:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=world, block_size=16)
    state = cp_compile.init_parallel(cfg, device="cpu")
    costs = state.collective_costs
    assert costs is not None
    out = {"costs": costs.to_json(), "rows": []}
    H, N = shape.heads, world
    g = torch.Generator().manual_seed(100 + rank)
    # The per-rank query projection (one copy per other rank under replicate): [H*dq, hidden].
    w_q = [torch.randn(H * shape.q_dim, shape.hidden, generator=g) * shape.hidden ** -0.5 for _ in range(N - 1)]
    qw = merge_cost.QueryWeights(bytes=4 * H * shape.q_dim * shape.hidden, matrix_elements=H * shape.q_dim * shape.hidden)
    pw, w_uv, w_uv_group = None, None, None
    if shape.out_dim is not None:  # MLA's W_UV [H, L, Dv]; the group's [N*H, L, Dv] (gathered at compile time)
        w_uv = torch.randn(H, shape.v_dim, shape.out_dim, generator=g) * shape.v_dim ** -0.5
        w_uv_group = torch.cat([w_uv] * N)
        pw = merge_cost.ProjectionWeights(bytes=4 * w_uv.numel(), matrix_elements=w_uv.numel(), out_dim=shape.out_dim)
    cands = [(m, p, False) for m, p in merge_cost.candidates(replicable=True, projectable=pw is not None)]
    w_o, w_o_group, fw = None, None, None
    if fold:  # this rank's o_proj [model hidden, H*Dv]; the group's columns [model hidden, N*H*Dv]
        dv = shape.out_dim or shape.v_dim
        w_o = torch.randn(shape.model_hidden, H * dv, generator=g) * (H * dv) ** -0.5
        w_o_group = torch.cat([w_o] * N, dim=1)
        fw = merge_cost.FoldWeights(bytes=4 * w_o.numel(), matrix_elements=w_o.numel(),
                                    extra_bytes=shape.layers * (N - 1) * (4 * w_o.numel() + (pw.bytes if pw else 0)),
                                    kv_bytes=kv_bytes, projection=pw)
        cands += [(m, p, True) for m, p in merge_cost.fold_candidates("auto", "on", weights=fw)[0]]
    names = [merge_cost.candidate(m, p, f) for m, p, f in cands]
    for T in batches:
        g = torch.Generator().manual_seed(rank)
        q = torch.randn(T, H, shape.q_dim, generator=g)
        x = torch.randn(T, shape.hidden, generator=g)
        part = torch.randn(T, N * H, shape.v_dim, generator=g)
        lse = torch.randn(T, N * H, generator=g)
        ctxs = {m: DCPContext(group=state.layout.cp, interleave=1, block_size=16, merge=m) for m in merge_cost.MERGES}

        def layer(name: str) -> None:
            m, projected = merge_cost.split_candidate(name)
            if m == "replicate":
                for w in w_q:
                    torch.nn.functional.linear(x, w)
            else:
                all_gather_heads(q, ctxs[m])
            if merge_cost.is_fold(name):  # LSE all-gather + rescale, (W_UV,) o_proj on the group's heads
                scaled = rescale_partial(Partial(part, lse, H, torch.float32), ctxs[m])
                if w_uv_group is not None:
                    scaled = torch.einsum("thl,hlv->thv", scaled, w_uv_group)
                torch.nn.functional.linear(scaled.flatten(1), w_o_group)
                return
            if projected:  # W_UV on the group's heads, then the merge of [T, N*H, Dv]
                merged = merge_heads(torch.einsum("thl,hlv->thv", part, w_uv_group), lse, ctxs[m], H,
                                     torch.float32)[0]
            else:  # the merge of [T, N*H, L], then W_UV on this rank's heads (none for GQA)
                merged = merge_heads(part, lse, ctxs[m], H, torch.float32)[0]
                if w_uv is not None:
                    merged = torch.einsum("thl,hlv->thv", merged, w_uv)
            if w_o is not None:  # this rank's o_proj
                torch.nn.functional.linear(merged.flatten(1), w_o)

        counted = {}
        for name in names:  # warm-up, and one layer's collectives counted at dispatch
            layer(name)
            with CollectiveMeter() as meter:
                layer(name)
            counted[name] = {"sent": dict(meter.sent), "calls": dict(meter.calls)}
        ms: dict[str, list[float]] = {c: [] for c in names}
        k = len(names)
        for r in range(rounds):
            order = names[r % k:] + names[:r % k]
            for c in (order if r % 2 == 0 else order[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(layers):
                    layer(c)
                t = torch.tensor([(time.perf_counter() - t0) * 1e3 / layers], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                ms[c].append(t.item())
        sizes = dict(tokens=T, heads=H, q_dim=shape.q_dim, v_dim=shape.v_dim, dtype_bytes=4)
        choice = merge_cost.choose(costs, **sizes, query_weights=qw, projection=pw, fold="auto" if fold else "off",
                                   fold_weights=fw)
        if fold:  # "+fold" predictions even where "auto" leaves them out (the KV fraction)
            for m, p, f in cands:
                if f:
                    choice.predicted_s.setdefault(merge_cost.candidate(m, p, f), merge_cost.predict(
                        costs, m, **sizes, query_weights=qw, projection=pw if p else None, fold=fw))
        chosen = merge_cost.candidate(choice.merge, choice.project, choice.fold)
        best = [min(ms[c][r] for c in ms) for r in range(rounds)]
        med = {c: statistics.median(v) for c, v in ms.items()}
        best_c = min(med, key=med.get)
        cand_rows = {}
        for m, p, f in cands:
            c = merge_cost.candidate(m, p, f)
            coll = merge_collectives(T, H, shape.q_dim, shape.out_dim if p else shape.v_dim, 4, N, m, fold=f)
            output_merge = [b for _, b in (coll if m == "replicate" else coll[1:])]  # all but the Q all-gather
            extra_weights = (N - 1) * (qw.bytes if m == "replicate" else 0) + ((N - 1) * pw.bytes if p else 0)
            extra_weights += (N - 1) * fw.bytes if f else 0
            cand_rows[c] = {
                "collectives_per_layer": counted[c]["calls"], "bytes_per_layer_measured": counted[c]["sent"],
                "bytes_per_layer_formula": sum(b for _, b in coll), "collectives_per_layer_formula": len(coll),
                "output_merge_bytes_formula": sum(output_merge),
                "bytes_per_step_measured": shape.layers * sum(counted[c]["sent"].values()),
                "collectives_per_step_measured": shape.layers * sum(counted[c]["calls"].values()),
                "extra_weight_bytes_per_layer": extra_weights,
                "predicted_ms": 1e3 * choice.predicted_s[c],
                "measured_ms": {"median": med[c], "min": min(ms[c]), "max": max(ms[c])}}
        out["rows"].append({
            "batch": T, "chosen": chosen, "decision": choice.to_json(), "best_measured": best_c,
            "within_spread": med[chosen] <= max(ms[best_c]), "candidates": cand_rows,
            "auto_regret": {"median": statistics.median(ms[chosen][r] / best[r] for r in range(rounds)),
                            "max": max(ms[chosen][r] / best[r] for r in range(rounds))}})
    cp_compile.destroy_parallel()
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(SHAPES), default="gqa")
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--out", default="results/merge_choice")
    ap.add_argument("--fold", action="store_true", help="o_proj in every layer, and the all-reduce fold candidates")
    ap.add_argument("--kv-gib", type=float, default=32.0, help="KV cache GiB per rank the fold's weights are weighed "
                    "against under auto")
    a = ap.parse_args(argv)
    shape = SHAPES[a.model]
    load0 = os.getloadavg()[0]
    res = run_on_ranks(_world, a.dcp, [int(b) for b in a.batch.split(",")], shape, a.rounds, a.layers, a.fold,
                       int(a.kv_gib * (1 << 30)), timeout=1800)[0]
    meta = {"commit": commit(), "load_avg_start": load0, "load_avg_end": os.getloadavg()[0], "dcp": a.dcp,
            "rounds": a.rounds, "layers": a.layers, "shape": dataclasses.asdict(shape), "fold": a.fold,
            "kv_gib": a.kv_gib}
    print(f"commit {meta['commit']}, load average {load0:.1f} -> {meta['load_avg_end']:.1f}, dcp {a.dcp} gloo ranks, "
          f"{a.rounds} rounds (rotated order) x {a.layers} layers, {shape.name}: {shape.heads} heads, q dim "
          f"{shape.q_dim}, partial dim {shape.v_dim}, projected dim {shape.out_dim}, hidden {shape.hidden}, fp32")
    c = res["costs"]
    print("calibrated (latency ms, ns/B): " + ", ".join(
        f"{k} {1e3 * c['latency_s'][k]:.3f} / {1e9 * c['seconds_per_byte'][k]:.2f}" for k in merge_cost.KINDS)
        + f"; matmul {1e9 * c['matmul_s_per_weight_byte']:.3f} ns/weight B, {1e12 * c['matmul_s_per_flop']:.1f} ps/flop")
    print("| batch | candidate | collectives / layer (counted) | bytes / layer counted (formula) | output-merge bytes "
          "(formula) | extra weight bytes / rank / layer | predicted ms / layer | measured ms / layer | chosen |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---|")
    for r in res["rows"]:
        for name, cr in r["candidates"].items():
            calls = ", ".join(f"{k} {v}" for k, v in sorted(cr["collectives_per_layer"].items()))
            sent = sum(cr["bytes_per_layer_measured"].values())
            m = cr["measured_ms"]
            mark = "**auto**" if name == r["chosen"] else ""
            mark += " (fastest)" if name == r["best_measured"] else ""
            print(f"| {r['batch']} | {name} | {calls} | {sent:,d} ({cr['bytes_per_layer_formula']:,d}) | "
                  f"{cr['output_merge_bytes_formula']:,d} | {cr['extra_weight_bytes_per_layer']:,d} | "
                  f"{cr['predicted_ms']:.2f} | {m['median']:.2f} ({m['min']:.2f}–{m['max']:.2f}) | {mark} |")
        print(f"|  | auto / fastest: {r['auto_regret']['median']:.2f} (max {r['auto_regret']['max']:.2f}), within "
              f"spread: {'yes' if r['within_spread'] else 'no'} | | | | | | | |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "merge_choice" + ("" if a.model == "gqa" else f"_{a.model}") + ("_fold" if a.fold else "")
    (out / f"{name}.json").write_text(json.dumps({"meta": meta, **res}, indent=1))


if __name__ == "__main__":
    main()
