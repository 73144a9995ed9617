"""The PNG: TPOT and KV bytes per rank against context length."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from examples.bench.args import BenchArgs


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return matplotlib, plt


def plot_decode(rows: list[dict[str, Any]], args: BenchArgs, path: Path) -> Path:
    """TPOT vs context (one line per (dcp, batch)) and KV bytes per rank vs context."""
    matplotlib, plt = _pyplot()
    import matplotlib.ticker

    fig, (ax_t, ax_kv) = plt.subplots(1, 2, figsize=(13, 5))
    styles = ["-", "--", ":", "-."]
    for i, dcp in enumerate(args.dcp):
        for j, batch in enumerate(args.batch):
            pts = sorted((r["context_len"], r) for r in rows if r["dcp"] == dcp and r["batch"] == batch)
            if not pts:
                continue
            ctx = [c for c, _ in pts]
            color = f"C{i}"
            ls = styles[j % len(styles)]
            label = f"dcp={dcp}, batch={batch}"
            ax_t.plot(ctx, [r["tpot_ms"] for _, r in pts], ls, marker="o", color=color, label=label)
            ax_kv.plot(ctx, [r["kv_cache_bytes_per_rank"] / 2**20 for _, r in pts], ls, marker="o", color=color,
                       label=label)
    title = (f"{args.model}, tp={args.tp}, {args.lowering}, {args.dtype}, merge={args.merge}, "
             f"block={args.block_size}, interleave={args.interleave}")
    for ax in (ax_t, ax_kv):
        ax.set_xscale("log", base=2)
        # Plain tick labels at the measured context lengths, not powers of two.
        ax.set_xticks(list(args.context), [str(c) for c in args.context])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_ylabel("TPOT (ms, median decode step, max over ranks)")
    ax_t.set_title("Decode time per output token")
    ax_kv.set_yscale("log")
    ax_kv.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax_kv.set_ylabel("KV cache per rank (MiB)")
    ax_kv.set_title("KV cache bytes per rank (pages used)")
    fig.suptitle(f"DCP vs TP baseline: {title}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
