"""`bench_prefill --pcp P`: TTFT of PCP (prefill tokens split over P groups) vs pcp = 1, side by side.

One world of `tp * pcp` ranks, initialised at `prefill_context_parallel_size = pcp`
(dcp = 1), holds two sides of the same model (same weights, same process), stepped
alternately like the DCP benchmark's (`decode.alternate_steps`), so a slow spell of
the shared machine hits both alike:

- side 0, the pcp = 1 baseline: the model compiled with the plain lowering over its
  own single-replica cache (pages of `block_size` tokens). Every PCP group runs the
  whole prompt: that is what a second replica gives a single request (nothing), and
  what this world's ranks would do without PCP;
- side 1, PCP: `cp_compile.compile_model` on the pcp parallel state; a prefill step
  runs the token-sharded prefill graph (`CompiledForward`, docs/pcp.md §4): each
  PCP rank computes its head-tail share of the new tokens, all-gathers K/V over
  PCP, and the logits come back in global order ([T, vocab] all-gather). Its cache
  is sharded over N = pcp ranks (virtual blocks of `block_size * pcp`).

A step's time is the max over all ranks; TTFT the median over steps; the paired
ratio (PCP / baseline, median over back-to-back step pairs) is on the PCP row.

The profiler's `dcp_comm` bucket counts every all-gather / reduce-scatter /
all-to-all: at dcp = 1 (the only --pcp world) those are exactly the PCP group's
collectives (K/V, Q, LSE merge, token indices, the logits' order restore; without
`--prefix` the step runs the fresh-step graph, which has no Q gather and no LSE
merge, docs/pcp.md §4), so the PCP table and breakdown print it as `pcp_comm`. `tp_comm` is the TP all-reduces.

`--prefix P` (chunked prefill on a cached prefix) works under PCP: the prefix is
written straight into each rank's shard at N = pcp (`cache.fill_context` with the
cp rank), the layout the PCP decode and chunked-prefill graphs read.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import cp_compile
from examples.bench.args import PrefillArgs
from examples.bench.cache import world_geometry
from examples.bench.decode import PlainCompiled, Side, _CountingBackend
from examples.bench.launch import log
from examples.bench.rows import pair_sides
from examples.bench.profile import CATEGORIES
from examples.bench.shapes import ModelSource

# The breakdown's column names under --pcp: the context-parallel bucket is the PCP group's.
LABELS = {c: ("pcp_comm" if c == "dcp_comm" else "pcp_local" if c == "dcp_local" else c) for c in CATEGORIES}


def init_pcp_world(args: PrefillArgs, device: torch.device) -> Any:
    """`init_parallel` for a world of tp * pcp ranks at dcp = 1 (the PCP side's config)."""
    cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, prefill_context_parallel_size=args.pcp,
                              cp_kv_cache_interleave_size=args.interleave, block_size=args.block_size)
    return cp_compile.init_parallel(cfg, device=device)


def build_pcp_sides(rank: int, args: PrefillArgs, source: ModelSource, state: Any, device: torch.device,
                    tokens_per_req: int) -> tuple[torch.nn.Module, list[Side]]:
    """The model on this rank (TP-sharded over its PCP group's tp ranks); side 0 the pcp = 1 baseline
    (plain lowering, its own pool), side 1 PCP (cp_ascend); each pool holds `max(args.batch)` requests
    of `tokens_per_req` tokens."""
    t0 = time.perf_counter()
    # tp, not the world size: every PCP group holds the whole model, TP-sharded the same way.
    model = source.build(args.tp, state.layout.tp.rank, state.tp_group)
    for p in model.parameters():  # parameters only: the rope inverse frequencies stay fp32 (as in HF)
        p.data = p.data.to(device=device, dtype=args.torch_dtype)
    model.to(device)
    base_cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, cp_kv_cache_interleave_size=args.interleave,
                                   block_size=args.block_size)
    sides = []
    for cfg in (base_cfg, state.cfg):
        # Pages per rank for pages of a virtual block of block_size * N tokens (N = 1 for the baseline).
        geom = world_geometry(args.block_size, cfg.context_parallel_size, tokens_per_req, max(args.batch), 0)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), geom.num_blocks, dtype=args.torch_dtype,
                                             device=device, attention=model.attention_spec())
        if cfg.prefill_context_parallel_size > 1:
            compiled = cp_compile.compile_model(model, lowering=args.lowering)

            def graphs(c: Any = compiled) -> int:  # one per batch kind run: fresh prefill, + prefill at --prefix
                return sum(len(b.pass_managers) for b in c.backends.values())

            sides.append(Side(cfg, "pcp", state.layout.cp.rank, cache, geom, compiled, graphs))
        else:
            backend = _CountingBackend(args.lowering)
            sides.append(Side(cfg, "none", 0, cache, geom, PlainCompiled(model.forward, backend),
                              lambda b=backend: b.graphs))
    log(rank, f"[pcp={args.pcp}] {args.shape} tp={args.tp} (world {args.ranks}): model built in "
              f"{time.perf_counter() - t0:.1f} s; "
              + "; ".join(f"pcp={s.cfg.prefill_context_parallel_size} pool {s.geom.num_blocks} pages x {args.block_size} tokens/rank "
                          f"({s.cache.sharded_bytes / 2**20:.2f} MiB KV/rank)" for s in sides)
              + f"; compiling with {args.lowering}")
    return model, sides


def format_pcp_table(rows: list[dict[str, Any]], args: PrefillArgs) -> str:
    """One line per (prompt, prefix, batch): TTFT pcp = 1 / pcp = P, their ratio, the paired ratio,
    attention-op and PCP-collective time (profiled), KV bytes per rank, graphs per side."""
    p = args.pcp
    head = (f"{'prompt':>7} {'prefix':>7} {'batch':>5} {'TTFT pcp=1':>11} {f'TTFT pcp={p}':>11} {'P/1':>6} "
            f"{'paired':>6} {'attn pcp=1':>10} {f'attn pcp={p}':>10} {f'pcp_comm':>9} {'KV/rank 1':>10} "
            f"{f'KV/rank {p}':>10} {'graphs':>7}")
    lines = [head, "-" * len(head)]
    for base, r in pair_sides(rows, args, "pcp", 1, args.pcp):
        prof = r["breakdown_ms"] and base["breakdown_ms"]
        attn = (f"{base['attention_ms']:>8.1f}ms {r['attention_ms']:>8.1f}ms {r['breakdown_ms']['dcp_comm']:>7.1f}ms"
                if prof else f"{'-':>10} {'-':>10} {'-':>9}")
        paired = r.get("ttft_ratio_paired")
        lines.append(f"{r['prompt_len']:>7} {r['context_len']:>7} {r['batch']:>5} {base['ttft_ms']:>9.1f}ms "
                     f"{r['ttft_ms']:>9.1f}ms {r['ttft_ms'] / base['ttft_ms']:>6.2f} "
                     f"{paired if paired is None else f'{paired:.2f}':>6} {attn} "
                     f"{base['kv_cache_bytes_per_rank'] / 2**20:>7.2f}MiB {r['kv_cache_bytes_per_rank'] / 2**20:>7.2f}MiB "
                     f"{base['graphs_compiled']:>3}/{r['graphs_compiled']:<3}")
    return "\n".join(lines)


def format_pcp_breakdown(rows: list[dict[str, Any]], args: PrefillArgs) -> str:
    """The profiled prefill step of each side: ms per category (mean over ranks), collectives per layer,
    and the slowest rank's step (head-tail balance shows as a spread between ranks)."""
    if not any(r["breakdown_ms"] for r in rows):
        return "(no profile: --profile-steps 0)"
    head = (f"{'prompt':>7} {'prefix':>7} {'batch':>5} {'pcp':>3} {'step':>9} "
            + " ".join(f"{LABELS[c]:>9}" for c in CATEGORIES) + f" {'PCP coll/layer':>14} {'TP coll/layer':>13}"
            + f" {'attn per rank':>20}")
    lines = [f"profiled prefill step (ms, median of {args.profile_steps} steps per rank, mean over ranks; "
             f"pcp_comm = the PCP group's collectives incl. the [T, vocab] logits all-gather)", head,
             "-" * len(head)]
    for pair in pair_sides(rows, args, "pcp", 1, args.pcp):
        for r in pair:
            bd, cpl = r["breakdown_ms"], r["collectives_per_layer"]
            if bd:
                per_rank = "/".join(f"{x['attention']:.0f}" for x in r["breakdown_ms_per_rank"])
                lines.append(f"{r['prompt_len']:>7} {r['context_len']:>7} {r['batch']:>5} {r['pcp']:>3} "
                             f"{bd['step']:>9.1f} " + " ".join(f"{bd[c]:>9.1f}" for c in CATEGORIES)
                             + f" {cpl['dcp']:>14g} {cpl['tp']:>13g} {per_rank:>20}")
    return "\n".join(lines)


def plot_pcp(rows: list[dict[str, Any]], args: PrefillArgs, path: Path) -> Path:
    """TTFT vs prompt length (pcp = 1 solid, pcp = P dashed, per variant and batch) and stacked bars of
    the profiled step per (prompt, variant, batch, pcp)."""
    from examples.bench.plot import _shape, prefill_figure, side_lines

    bars = sorted((r for r in rows if r["breakdown_ms"]),
                  key=lambda r: (r["prompt_len"], r["context_len"], r["batch"], r["pcp"]))
    return prefill_figure(
        args, path, lines=side_lines(rows, args, "pcp", (1, args.pcp), lambda pcp: f"pcp={pcp}"),
        bars=bars, bar_label=lambda r: f"{r['prompt_len']}\n{r['variant']} b{r['batch']}\npcp={r['pcp']}",
        ttft_title=f"Time to first token, pcp={args.pcp} vs pcp=1",
        bars_title="Where the prefill step goes (torch profiler)", labels=LABELS,
        suptitle=f"Prefill, PCP vs pcp=1: {_shape(args)}, tp={args.tp}, pcp={args.pcp} (world {args.ranks}), "
                 f"{args.lowering}, {args.dtype}, block={args.block_size}")
