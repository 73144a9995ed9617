"""Prefill benchmark in graph mode: TTFT of the TP baseline (dcp = 1) vs DCP at the same world size.

For each (dcp, merge) one world of `--tp` ranks builds the TP-sharded example model
(`--shape`: tiny, or a real deployment's per-rank attention), compiles it with the
cp_ascend backend and, beside it, as the dcp = 1 baseline with the plain lowering,
and sweeps prompt length x batch: one step prefills `batch` requests of `prompt`
tokens each; with `--prefix P` a chunked variant starts from P cached tokens per
request (written straight into the KV pools) and prefills the rest. `--warmup`
untimed, `--steps` timed and `--profile-steps` profiled steps, DCP and baseline
alternating; a step's time is the max over ranks and TTFT the median over steps
(`examples/bench/prefill.py` has the details, `docs/benchmarks.md` the figures,
`docs/benchmarks_log.md` every run and what they mean: DCP halves the KV bytes per
rank but not the prefill compute).

Writes `<out>/bench_prefill.json` (one row per world x (dcp, prompt, prefix, batch))
and `<out>/bench_prefill.png`, and prints the tables. Progress goes to stderr. From
the repo root:

    python examples/bench_prefill.py --tp 2 --dcp 2 --prompt 1024,4096 --prefix 512 --batch 1
    python -m examples.bench_prefill ...           (the same)
    torchrun --nproc-per-node=2 examples/bench_prefill.py --tp 2 --dcp 2
    python examples/bench_prefill.py --shape deepseek-v32-tp8 --tp 2 --dsa-cp --prompt 1024,4096

`--dsa-cp` (SFA models) replaces the DCP worlds with one dcp = 1 world timing DSA-CP
off (plain TP) vs on side by side (`examples/bench/dsa_cp.py`).

`--pcp P` (GQA / MLA) replaces them with one world of tp * P ranks timing PCP (the
prefill's tokens split over P groups) vs the pcp = 1 baseline at the same tp side by
side (`examples/bench/pcp.py`):

    python examples/bench_prefill.py --shape qwen3-235b-a22b-tp8 --tp 1 --pcp 2 --prompt 8192 --batch 1

Without torchrun the script spawns its own gloo ranks (`run_on_ranks`); under
torchrun (env RANK set) every process runs the same per-rank code directly.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Sequence

if not __package__:  # run as a script: make the repo root, not examples/, the import root (as `-m` would)
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from examples.bench.args import parse_prefill_args  # noqa: E402
from examples.bench.decode import decode_source  # noqa: E402
from examples.bench.dsa_cp import format_dsa_cp_breakdown, format_dsa_cp_table, plot_dsa_cp  # noqa: E402
from examples.bench.launch import run  # noqa: E402
from examples.bench.pcp import format_pcp_breakdown, format_pcp_table, plot_pcp  # noqa: E402
from examples.bench.plot import plot_prefill  # noqa: E402
from examples.bench.prefill import run_world  # noqa: E402
from examples.bench.rows import write_json  # noqa: E402
from examples.bench.table import format_prefill_breakdown, format_prefill_table, format_prefill_worlds  # noqa: E402


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the sweep, write JSON + PNG (rank 0), print the tables; returns the rows."""
    args = parse_prefill_args(argv, description=__doc__.split("\n\n")[0])
    t0 = time.perf_counter()
    rows, writer = run(args, run_world, decode_source)  # type: ignore[arg-type]
    if not writer:
        return rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_json(rows, out, "bench_prefill.json")
    png = out / "bench_prefill.png"
    shape = args.model if args.shape == "tiny" else f"{args.shape} ({args.model})"
    steps = (f"prompt={list(args.prompt)} prefix={args.prefix} batch={list(args.batch)} steps={args.steps} "
             f"warmup={args.warmup} profile_steps={args.profile_steps}")
    if args.dsa_cp:
        png_path = plot_dsa_cp(rows, args, png)
        header = (f"{shape} tp={args.tp} DSA-CP off vs on, lowering={args.lowering} dtype={args.dtype} "
                  f"block={args.block_size} {steps}")
        tables = [format_dsa_cp_table(rows, args), format_dsa_cp_breakdown(rows, args)]
    elif args.pcp > 1:
        png_path = plot_pcp(rows, args, png)
        header = (f"{shape} tp={args.tp} pcp={args.pcp} (world {args.ranks}) vs pcp=1, lowering={args.lowering} "
                  f"dtype={args.dtype} block={args.block_size} interleave={args.interleave} {steps}")
        tables = [format_pcp_table(rows, args), format_pcp_breakdown(rows, args)]
    else:
        png_path = plot_prefill(rows, args, png)
        header = (f"{shape} tp={args.tp} dcp={list(args.dcp)} lowering={args.lowering} dtype={args.dtype} "
                  f"merge={','.join(args.merge)} block={args.block_size} interleave={args.interleave} {steps}")
        tables = [format_prefill_table(rows, args), format_prefill_breakdown(rows, args),
                  format_prefill_worlds(rows, args)]
    print(f"\n{header} ({time.perf_counter() - t0:.0f} s)")
    for text in tables:
        print(text + "\n")
    if any(r["recompiled_in_timed_steps"] for r in rows):
        print("WARNING: a graph was compiled during timed steps; raise --warmup", flush=True)
    print(f"wrote {json_path}, {png_path}", flush=True)
    return rows


if __name__ == "__main__":
    main()
