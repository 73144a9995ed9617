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


def _shape(args: BenchArgs) -> str:
    return args.model if args.shape == "tiny" else args.shape


def plot_decode(rows: list[dict[str, Any]], args: BenchArgs, path: Path) -> Path:
    """TPOT vs context (one line per (dcp, batch)) and KV bytes per rank vs context."""
    matplotlib, plt = _pyplot()
    import matplotlib.ticker

    fig, (ax_t, ax_kv) = plt.subplots(1, 2, figsize=(13, 5))
    styles = ["-", "--", ":", "-."]
    series = list(dict.fromkeys((tuple(r["world"]), r["dcp"], r["merge"]) for r in rows))
    for i, (world, dcp, merge) in enumerate(series):
        for j, batch in enumerate(args.batch):
            pts = sorted(((r["context_len"], r) for r in rows if (tuple(r["world"]), r["dcp"], r["batch"])
                          == (world, dcp, batch)), key=lambda p: p[0])
            if not pts:
                continue
            ctx = [c for c, _ in pts]
            color = f"C{i}"
            ls = styles[j % len(styles)]
            label = f"dcp={dcp}, batch={batch}"
            if len(args.merge) > 1:
                label += f", {merge}" if dcp > 1 else f" (beside {world[1]})"
            ax_t.plot(ctx, [r["tpot_ms"] for _, r in pts], ls, marker="o", color=color, label=label)
            ax_kv.plot(ctx, [r["kv_cache_bytes_per_rank"] / 2**20 for _, r in pts], ls, marker="o", color=color,
                       label=label)
    title = (f"{_shape(args)}, tp={args.tp}, {args.lowering}, {args.dtype}, merge={','.join(args.merge)}, "
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


def plot_breakdown(rows: list[dict[str, Any]], args: BenchArgs, path: Path) -> Path | None:
    """Stacked bars of the profiled step per (context, dcp[, merge]), one panel per batch size."""
    from examples.bench.profile import CATEGORIES

    if not any(r["breakdown_ms"] for r in rows):
        return None
    _, plt = _pyplot()
    worlds = list(args.worlds)
    fig, axes = plt.subplots(1, len(args.batch), figsize=(max(6.0, 1.0 * 2 * len(worlds) * len(args.context) + 2)
                                                          * len(args.batch), 4.5), squeeze=False)
    colors = {"attention": "C0", "dcp_local": "C1", "dcp_comm": "C3", "tp_comm": "C2", "other": "C7"}
    by = {(tuple(r["world"]), r["dcp"], r["context_len"], r["batch"]): r for r in rows}
    for ax, batch in zip(axes[0], args.batch):
        x, labels = 0.0, []
        ticks = []
        for context in args.context:
            for world, dcp in ((w, d) for w in worlds for d in sorted({1, w[0]})):
                merge = world[1]
                r = by.get((world, dcp, context, batch))
                if r is None or not r["breakdown_ms"]:
                    continue
                bottom = 0.0
                for c in CATEGORIES:
                    v = r["breakdown_ms"][c]
                    ax.bar(x, v, bottom=bottom, color=colors[c], width=0.8,
                           label=c if not labels else None)
                    bottom += v
                labels.append(f"{context}\ndcp={dcp}" + (f"\n{merge}" if len(args.merge) > 1 and dcp > 1 else
                                                           f"\n(beside {merge})" if len(args.merge) > 1 else ""))
                ticks.append(x)
                x += 1
            x += 0.6
        ax.set_xticks(ticks, labels, fontsize=7)
        ax.set_ylabel("ms per decode step (median, mean over ranks)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Where the decode step goes (torch profiler): {_shape(args)}, tp={args.tp}, {args.lowering}, "
                 f"{args.dtype}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


Line = tuple[str, list[dict[str, Any]], str, str]  # (label, rows sorted by prompt, line style, colour)


def prefill_figure(args: Any, path: Path, *, lines: list[Line], bars: list[dict[str, Any]], bar_label: Any,
                   ttft_title: str, bars_title: str, suptitle: str, labels: dict[str, str] | None = None) -> Path:
    """The prefill PNG every prefill comparison draws (DCP, DSA-CP, PCP): TTFT vs prompt
    length, one line per entry of `lines`, and the profiled step's breakdown as stacked
    bars, one per row of `bars` (labelled by `bar_label(row)`; `labels` renames buckets)."""
    from examples.bench.profile import CATEGORIES

    _, plt = _pyplot()
    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(14, 5))
    for label, pts, style, color in lines:
        ax_t.plot([r["prompt_len"] for r in pts], [r["ttft_ms"] for r in pts], style, marker="o", color=color,
                  label=label)
    ax_t.set_xscale("log", base=2)
    ax_t.set_xticks(list(args.prompt), [str(p) for p in args.prompt])
    ax_t.minorticks_off()
    ax_t.set_xlabel("prompt length (tokens per request)")
    ax_t.set_ylabel("TTFT (ms, median prefill step, max over ranks)")
    ax_t.set_title(ttft_title)
    ax_t.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    colors = {"attention": "C0", "dcp_local": "C1", "dcp_comm": "C3", "tp_comm": "C2", "other": "C7"}
    labels = labels or {}
    for x, r in enumerate(bars):
        bottom = 0.0
        for c in CATEGORIES:
            ax_b.bar(x, r["breakdown_ms"][c], bottom=bottom, color=colors[c], width=0.8,
                     label=labels.get(c, c) if x == 0 else None)
            bottom += r["breakdown_ms"][c]
    ax_b.set_xticks(range(len(bars)), [bar_label(r) for r in bars], fontsize=7)
    ax_b.set_ylabel("ms per prefill step (median, mean over ranks)")
    ax_b.set_title(bars_title)
    ax_b.grid(True, axis="y", alpha=0.3)
    if bars:
        ax_b.legend(fontsize=7)
    fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def variant_label(variant: str, batch: int, args: Any) -> str:
    return variant + (f" (prefix {args.prefix})" if variant == "chunked" else "") + f", batch={batch}"


def side_lines(rows: list[dict[str, Any]], args: Any, field: str, sides: tuple[Any, Any],
               name: Any) -> list[Line]:
    """Lines of a two-sided prefill comparison in one world (DSA-CP off / on, pcp 1 / N):
    one colour per (variant, batch), the baseline side `sides[0]` solid, the other dashed;
    `name(side)` labels a side."""
    lines: list[Line] = []
    for i, (variant, batch) in enumerate(dict.fromkeys((r["variant"], r["batch"]) for r in rows)):
        for side in sides:
            pts = sorted((r for r in rows if (r["variant"], r["batch"], r[field]) == (variant, batch, side)),
                         key=lambda r: r["prompt_len"])
            lines.append((f"{name(side)} {variant_label(variant, batch, args)}", pts,
                          "-" if side == sides[0] else "--", f"C{i}"))
    return lines


def plot_prefill(rows: list[dict[str, Any]], args: Any, path: Path) -> Path:
    """TTFT vs prompt length, one line per (dcp, variant, batch), and the profiled step's breakdown
    per (prompt, variant, dcp) for the largest batch."""
    series = list(dict.fromkeys((tuple(r["world"]), r["dcp"], r["variant"], r["batch"]) for r in rows))
    lines: list[Line] = []
    for i, (world, dcp, variant, batch) in enumerate(series):
        pts = sorted((r for r in rows if (tuple(r["world"]), r["dcp"], r["variant"], r["batch"])
                      == (world, dcp, variant, batch)), key=lambda r: r["prompt_len"])
        label = f"dcp={dcp} {variant_label(variant, batch, args)}" + (f", {world[1]}" if len(args.merge) > 1 else "")
        lines.append((label, pts, "-" if dcp == 1 else "--", f"C{i}"))
    batch = max(args.batch)
    bars = sorted((r for r in rows if r["batch"] == batch and r["breakdown_ms"]),
                  key=lambda r: (r["prompt_len"], r["context_len"], tuple(r["world"]), r["dcp"]))
    return prefill_figure(
        args, path, lines=lines, bars=bars,
        bar_label=lambda r: f"{r['prompt_len']}\n{r['variant']}\ndcp={r['dcp']}",
        ttft_title="Time to first token", bars_title=f"Where the prefill step goes (torch profiler), batch {batch}",
        suptitle=f"Prefill, DCP vs TP baseline: {_shape(args)}, tp={args.tp}, {args.lowering}, {args.dtype}, "
                 f"merge={','.join(args.merge)}, block={args.block_size}")
