"""A small benchmark library for the example models: decode and prefill (SFA shapes next).

One module per idea, so another benchmark reuses what it needs:

- `args`: `BenchArgs` / `PrefillArgs` (every option, one picklable dataclass shipped to the ranks)
  and the parsers;
- `shapes`: `--shape` presets with real deployments' per-rank attention, and what a rank builds from;
- `models`: the tiny HF model, attention dims, bytes-per-step model;
- `cache`: KV pool geometry fixed per world, and filling a context straight into a rank's shard;
- `timing`: barrier-bracketed steps, the max over ranks, median;
- `profile`: where a step's time goes, from the torch profiler (attention, DCP / TP collectives, rest);
- `launch`: one world per (dcp, merge), spawned gloo ranks (`run_on_ranks`) or torchrun;
- `decode`: the per-world decode sweep, DCP and its dcp = 1 baseline alternating step by step,
  and the compile probe -> rows; its world setup and step alternation are shared with prefill;
- `prefill`: the per-world prefill sweep (whole prompt, and a chunk after a cached prefix), TTFT
  of DCP and its dcp = 1 baseline alternating step by step -> rows;
- `rows`: the JSON row of one config, KV-budget figures, pooling `--repeat` passes, writing;
- `table`: the tables (against the baseline, breakdown, compiles, KV budget);
- `plot`: the PNGs (TPOT / KV bytes, stacked breakdown bars).

The CLIs (`examples/bench_decode.py`, `examples/bench_prefill.py`) only parse, launch and write.
"""
