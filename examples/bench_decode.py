"""Decode benchmark in graph mode: TP baseline (dcp = 1) vs DCP at the same world size (docs/architecture.md §9).

For each (dcp, merge) one world of `--tp` ranks builds the TP-sharded example model
(`--shape`: tiny, or a real deployment's per-rank attention), compiles it with the
cp_ascend backend and, beside it, as the dcp = 1 baseline with the plain lowering,
and sweeps context length x batch: the context is written straight into each KV
pool, then `--warmup` untimed, `--steps` timed and `--profile-steps` profiled decode
steps, DCP and baseline alternating; a step's time is the max over ranks and TPOT
the median over steps (`examples/bench/decode.py` has the details,
`docs/benchmarks.md` the current figures, `docs/benchmarks_log.md` every run and what
they mean).

Writes `<out>/bench_decode.json` (one row per world x (dcp, context, batch)),
`<out>/bench_decode.png` and `<out>/bench_decode_breakdown.png`, and prints the
tables. Progress goes to stderr. From the repo root:

    python examples/bench_decode.py --tp 2 --dcp 1,2 --context 256,1024,4096 --batch 1,4
    python examples/bench_decode.py --shape qwen3-235b-a22b-tp8 --dcp 2 --merge ag_rs,a2a --context 32768 --batch 8
    python -m examples.bench_decode ...           (the same)
    python examples/bench_decode.py --model mla --tp 2 --dcp 2 --spec-tokens 2 --context 64 --batch 2
                                                  (speculative decoding on vs off: examples/bench/spec.py)
    torchrun --nproc-per-node=2 examples/bench_decode.py --tp 2 --dcp 1,2

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

from examples.bench.args import parse_args  # noqa: E402
from examples.bench.decode import decode_source, run_world  # noqa: E402
from examples.bench.launch import run  # noqa: E402
from examples.bench.plot import plot_breakdown, plot_decode  # noqa: E402
from examples.bench.rows import write_json  # noqa: E402
from examples.bench.table import format_breakdown, format_kv_budget, format_table, format_worlds  # noqa: E402


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the sweep, write JSON + PNG (rank 0), print the table; returns the rows."""
    args = parse_args(argv, description=__doc__.split("\n\n")[0])
    t0 = time.perf_counter()
    if args.spec_tokens:
        return _spec_main(args, t0)
    rows, writer = run(args, run_world, decode_source)
    if not writer:
        return rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_json(rows, out, "bench_decode.json")
    png_path = plot_decode(rows, args, out / "bench_decode.png")
    bars_path = plot_breakdown(rows, args, out / "bench_decode_breakdown.png")
    shape = args.model if args.shape == "tiny" else f"{args.shape} ({args.model})"
    print(f"\n{shape} tp={args.tp} dcp={list(args.dcp)} lowering={args.lowering} dtype={args.dtype} "
          f"merge={','.join(args.merge)} block={args.block_size} interleave={args.interleave} "
          f"steps={args.steps} warmup={args.warmup} profile_steps={args.profile_steps} "
          f"({time.perf_counter() - t0:.0f} s)")
    for text in (format_table(rows, args), format_breakdown(rows, args), format_worlds(rows, args),
                 format_kv_budget(rows, args)):
        print(text + "\n")
    if any(r["recompiled_in_timed_steps"] for r in rows):
        print("WARNING: a graph was compiled during timed steps; raise --warmup", flush=True)
    written = ", ".join(str(p) for p in (json_path, png_path, bars_path) if p is not None)
    print(f"wrote {written}", flush=True)
    return rows


def _spec_main(args: Any, t0: float) -> list[dict[str, Any]]:
    """`--spec-tokens k`: speculation on vs off per DCP world, one JSON file and a table."""
    from examples.bench.spec import format_spec_table, spec_source, spec_world

    rows, writer = run(args, spec_world, spec_source, post=lambda r: r)
    if not writer:
        return rows
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = write_json(rows, out, "bench_decode_spec.json")
    print(f"\n{args.model} tp={args.tp} dcp={list(args.dcp)} spec_tokens={args.spec_tokens} proposer={args.proposer} "
          f"lowering={args.lowering} steps={args.steps} ({time.perf_counter() - t0:.0f} s)")
    print(format_spec_table(rows) + "\n")
    if any(r["recompiled_in_timed_steps"] for r in rows):
        print("WARNING: a graph was compiled during timed steps", flush=True)
    print(f"wrote {path}", flush=True)
    return rows


if __name__ == "__main__":
    main()
