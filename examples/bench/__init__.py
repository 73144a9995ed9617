"""A small benchmark library for the example models (decode today; prefill and SFA next).

One module per idea, so another benchmark reuses what it needs:

- `args`: `BenchArgs` (every option, one picklable dataclass shipped to the ranks) and the parser;
- `models`: building the benchmark model on a rank, its attention dims, bytes-per-step model;
- `cache`: KV pool geometry fixed per world, and filling a context straight into a rank's shard;
- `timing`: barrier-bracketed steps, the max over ranks, median;
- `launch`: one world per DCP size, spawned gloo ranks (`run_on_ranks`) or torchrun;
- `decode`: the per-world decode sweep (compile once, fill, warm up, time) -> rows;
- `rows`: the JSON row of one config and writing them;
- `table`: the comparison table against the dcp = 1 baseline;
- `plot`: the PNG.

The CLIs (`examples/bench_decode.py`) only parse, launch and write.
"""
