"""The comparison table: each dcp = N config against the dcp = 1 baseline."""

from __future__ import annotations

from typing import Any

from examples.bench.args import BenchArgs


def mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def format_table(rows: list[dict[str, Any]], args: BenchArgs) -> str:
    """One line per (context, batch, dcp=N > 1) against the dcp = 1 baseline."""
    by = {(r["dcp"], r["context_len"], r["batch"]): r for r in rows}
    head = (f"{'context':>8} {'batch':>5} {'N':>3} {'TPOT dcp=1':>11} {'TPOT dcp=N':>11} {'N/1':>6} "
            f"{'KV/rank dcp=1':>14} {'KV/rank dcp=N':>14} {'KV N/1':>7} {'DCP comm B/step':>16} "
            f"{'TP AR B/step':>13}")
    lines = [head, "-" * len(head)]
    for context in args.context:
        for batch in args.batch:
            base = by.get((1, context, batch))
            for n in (d for d in args.dcp if d > 1):
                r = by.get((n, context, batch))
                if base is None or r is None:
                    continue
                lines.append(
                    f"{context:>8} {batch:>5} {n:>3} {base['tpot_ms']:>9.2f}ms {r['tpot_ms']:>9.2f}ms "
                    f"{r['tpot_ms'] / base['tpot_ms']:>6.2f} {mib(base['kv_cache_bytes_per_rank']):>14} "
                    f"{mib(r['kv_cache_bytes_per_rank']):>14} "
                    f"{r['kv_cache_bytes_per_rank'] / base['kv_cache_bytes_per_rank']:>7.3f} "
                    f"{r['comm_bytes_per_step']:>16,} {r['tp_allreduce_bytes_per_step']:>13,}")
    return "\n".join(lines)
