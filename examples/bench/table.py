"""Tables: each dcp = N world against the dcp = 1 baseline, where the step time goes,
compile and recompile counts, and the context that fits a KV budget."""

from __future__ import annotations

from typing import Any

from examples.bench.args import BenchArgs
from examples.bench.profile import CATEGORIES


def mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def _ratio(a: float | None, b: float | None, width: int, digits: int = 2) -> str:
    return f"{a / b:>{width}.{digits}f}" if a is not None and b else f"{'-':>{width}}"


def _key(r: dict[str, Any]) -> tuple[Any, ...]:
    """(world dcp, world merge, dcp, context, batch): a baseline row belongs to the world it ran in."""
    return r["world"][0], r["world"][1], r["dcp"], r["context_len"], r["batch"]


def _label(r: dict[str, Any]) -> str:
    return r["merge"] if r["dcp"] > 1 else f"({r['world'][1]})" if r["world"][0] > 1 else "none"


def format_table(rows: list[dict[str, Any]], args: BenchArgs) -> str:
    """One line per (context, batch, dcp=N > 1, merge) against the dcp = 1 baseline timed alongside it.

    N/1: median TPOT over median TPOT; paired: median over steps of each step's ratio to
    the baseline step next to it; attn N/1: attention-op time (profiled) ratio.
    """
    by = {_key(r): r for r in rows}
    head = (f"{'context':>8} {'batch':>5} {'N':>3} {'merge':>5} {'TPOT dcp=1':>11} {'TPOT dcp=N':>11} {'N/1':>6} "
            f"{'paired':>6} {'attn N/1':>8} {'KV/rank dcp=1':>14} {'KV/rank dcp=N':>14} {'KV N/1':>7} {'DCP comm B/step':>16} "
            f"{'TP AR B/step':>13}")
    lines = [head, "-" * len(head)]
    for context in args.context:
        for batch in args.batch:
            for n, merge in (w for w in args.worlds if w[0] > 1):
                base = by.get((n, merge, 1, context, batch))
                r = by.get((n, merge, n, context, batch))
                if base is None or r is None:
                    continue
                lines.append(
                    f"{context:>8} {batch:>5} {n:>3} {merge:>5} {base['tpot_ms']:>9.2f}ms {r['tpot_ms']:>9.2f}ms "
                    f"{r['tpot_ms'] / base['tpot_ms']:>6.2f} {_ratio(r.get('tpot_ratio_paired'), 1.0, 6)} "
                    f"{_ratio(r['attention_ms'], base['attention_ms'], 8)} "
                    f"{mib(base['kv_cache_bytes_per_rank']):>14} {mib(r['kv_cache_bytes_per_rank']):>14} "
                    f"{r['kv_cache_bytes_per_rank'] / base['kv_cache_bytes_per_rank']:>7.3f} "
                    f"{r['comm_bytes_per_step']:>16,} {r['tp_allreduce_bytes_per_step']:>13,}")
    return "\n".join(lines)


def format_breakdown(rows: list[dict[str, Any]], args: BenchArgs) -> str:
    """Median profiled step per config: ms per category (mean over ranks), collectives per layer."""
    if not any(r["breakdown_ms"] for r in rows):
        return "(no profile: --profile-steps 0)"
    head = (f"{'context':>8} {'batch':>5} {'dcp':>3} {'merge':>7} {'step':>8} "
            + " ".join(f"{c:>9}" for c in CATEGORIES) + f" {'DCP coll/layer':>14} {'TP coll/layer':>13}")
    lines = [f"profiled step (ms, median of {args.profile_steps} steps per rank, mean over ranks; "
             f"'(m)': the dcp = 1 baseline timed alongside merge m)", head,
             "-" * len(head)]
    order = {w: i for i, w in enumerate(args.worlds)}
    for r in sorted(rows, key=lambda r: (r["context_len"], r["batch"], order.get(tuple(r["world"]), 0), r["dcp"])):
        bd = r["breakdown_ms"]
        if not bd:
            continue
        cpl = r["collectives_per_layer"]
        lines.append(f"{r['context_len']:>8} {r['batch']:>5} {r['dcp']:>3} {_label(r):>7} {bd['step']:>8.2f} "
                     + " ".join(f"{bd[c]:>9.2f}" for c in CATEGORIES)
                     + f" {cpl['dcp']:>14g} {cpl['tp']:>13g}")
    return "\n".join(lines)


def format_worlds(rows: list[dict[str, Any]], args: BenchArgs) -> str:
    """Per world: graphs compiled, recompiles after warm-up, compile time cp_ascend vs plain."""
    head = (f"{'dcp':>3} {'merge':>5} {'graphs':>6} {'recompiles after warm-up':>24} {'compile cp_ascend':>17} "
            f"{'compile ' + args.lowering:>17} {'ratio':>6} {'backend cp/plain':>16} {'DCP pass':>8}")
    lines = [head, "-" * len(head)]
    for dcp, merge in args.worlds:
        rs = [r for r in rows if tuple(r["world"]) == (dcp, merge)]
        if not rs:
            continue
        r = [x for x in rs if x["dcp"] == dcp][-1]
        cp, plain = r["compile_s_cp_ascend"], r["compile_s_plain"]
        lines.append(f"{dcp:>3} {merge:>5} {r['graphs_compiled']:>6} {max(x['recompiles_after_warmup'] for x in rs):>24} "
                     + (f"{cp:>16.1f}s {plain:>16.1f}s {cp / plain:>6.2f} "
                        f"{r['backend_s_cp_ascend']:>6.1f}s/{r['backend_s_plain']:>6.1f}s {r['dcp_pass_s']:>7.2f}s"
                        if cp is not None else f"{'-':>17} {'-':>17} {'-':>6}"))
    return "\n".join(lines)


def format_kv_budget(rows: list[dict[str, Any]], args: BenchArgs) -> str:
    """Largest context per request that fits the KV budget per rank, dcp = 1 vs N."""
    r0 = rows[0]
    lines = [f"KV budget {args.kv_budget_gib:g} GiB per rank, {r0['kv_budget_layers']} layers, {args.dtype}, "
             f"block {args.block_size}: largest context per request"]
    head = f"{'batch':>5} " + " ".join(f"{f'dcp={d}':>12}" for d in args.dcp) + f" {'KV B/token/rank':>24}"
    lines += [head, "-" * len(head)]
    for batch in args.batch:
        cells, per_token = [], []
        for d in args.dcp:
            r = next((x for x in rows if x["dcp"] == d and x["batch"] == batch), None)
            cells.append(f"{r['kv_budget_max_context']:>12,}" if r else f"{'-':>12}")
            if r:
                per_token.append(str(r["kv_bytes_per_token_per_rank"]))
        lines.append(f"{batch:>5} " + " ".join(cells) + f" {' / '.join(per_token):>24}")
    return "\n".join(lines)


def format_prefill_table(rows: list[dict[str, Any]], args: Any) -> str:
    """One line per (prompt, batch, variant, dcp = N > 1, merge) against the dcp = 1 baseline beside it.

    N/1: median TTFT over median TTFT; paired: median over steps of each step's ratio to
    the baseline step next to it; attn N/1: attention-op time (profiled) ratio.
    """
    by = {(*_key(r), r["prompt_len"]): r for r in rows}
    head = (f"{'prompt':>7} {'prefix':>7} {'batch':>5} {'N':>3} {'merge':>5} {'TTFT dcp=1':>11} {'TTFT dcp=N':>11} "
            f"{'N/1':>6} {'paired':>6} {'attn N/1':>8} {'KV/rank dcp=1':>14} {'KV/rank dcp=N':>14} "
            f"{'DCP comm B/step':>16}")
    lines = [head, "-" * len(head)]
    for prompt in args.prompt:
        for batch in args.batch:
            for prefix in args.chunks(prompt):
                for n, merge in (w for w in args.worlds if w[0] > 1):
                    base = by.get((n, merge, 1, prefix, batch, prompt))
                    r = by.get((n, merge, n, prefix, batch, prompt))
                    if base is None or r is None:
                        continue
                    lines.append(
                        f"{prompt:>7} {prefix:>7} {batch:>5} {n:>3} {merge:>5} {base['ttft_ms']:>9.1f}ms "
                        f"{r['ttft_ms']:>9.1f}ms {r['ttft_ms'] / base['ttft_ms']:>6.2f} "
                        f"{_ratio(r.get('ttft_ratio_paired'), 1.0, 6)} "
                        f"{_ratio(r['attention_ms'], base['attention_ms'], 8)} "
                        f"{mib(base['kv_cache_bytes_per_rank']):>14} {mib(r['kv_cache_bytes_per_rank']):>14} "
                        f"{r['comm_bytes_per_step']:>16,}")
    return "\n".join(lines)


def format_prefill_breakdown(rows: list[dict[str, Any]], args: Any) -> str:
    """Median profiled prefill step per config: ms per category (mean over ranks), collectives per layer."""
    if not any(r["breakdown_ms"] for r in rows):
        return "(no profile: --profile-steps 0)"
    head = (f"{'prompt':>7} {'prefix':>7} {'batch':>5} {'dcp':>3} {'merge':>7} {'step':>9} "
            + " ".join(f"{c:>9}" for c in CATEGORIES) + f" {'DCP coll/layer':>14} {'TP coll/layer':>13}")
    lines = [f"profiled prefill step (ms, median of {args.profile_steps} steps per rank, mean over ranks; "
             f"'(m)': the dcp = 1 baseline timed alongside merge m)", head, "-" * len(head)]
    order = {w: i for i, w in enumerate(args.worlds)}
    for r in sorted(rows, key=lambda r: (r["prompt_len"], r["context_len"], r["batch"],
                                         order.get(tuple(r["world"]), 0), r["dcp"])):
        bd = r["breakdown_ms"]
        if not bd:
            continue
        cpl = r["collectives_per_layer"]
        lines.append(f"{r['prompt_len']:>7} {r['context_len']:>7} {r['batch']:>5} {r['dcp']:>3} {_label(r):>7} "
                     f"{bd['step']:>9.1f} " + " ".join(f"{bd[c]:>9.1f}" for c in CATEGORIES)
                     + f" {cpl['dcp']:>14g} {cpl['tp']:>13g}")
    return "\n".join(lines)


def format_prefill_worlds(rows: list[dict[str, Any]], args: Any) -> str:
    """Per world: graphs compiled and recompiles after warm-up (must be 0)."""
    lines = []
    for dcp, merge in args.worlds:
        rs = [r for r in rows if tuple(r["world"]) == (dcp, merge)]
        if rs:
            lines.append(f"world dcp={dcp} {merge}: graphs " + ", ".join(
                f"dcp={d} {max(r['graphs_compiled'] for r in rs if r['dcp'] == d)}" for d in sorted({1, dcp}))
                + f"; recompiles after warm-up {max(r['recompiles_after_warmup'] for r in rs)}")
    return "\n".join(lines)
