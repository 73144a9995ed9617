"""`examples/bench_decode.py` end to end at a minimal size (aot_eager, two tiny worlds)."""

from __future__ import annotations

import json
from pathlib import Path

from examples import bench_decode

REQUIRED = ("kind", "tp", "dcp", "interleave", "batch", "context_len", "tpot_ms", "kv_cache_bytes_per_rank",
            "max_context_tokens_per_rank", "comm_bytes_per_step", "tp_allreduce_bytes_per_step", "lowering",
            "dtype", "merge")


def test_bench_decode_minimal(tmp_path: Path) -> None:
    rows = bench_decode.main(["--tp", "2", "--dcp", "2", "--context", "40", "--batch", "1,2", "--steps", "1",
                              "--warmup", "1", "--lowering", "aot_eager", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "bench_decode.json").read_text())
    assert written == json.loads(json.dumps(rows))
    # dcp=1 (the TP baseline) is added even when not asked for.
    assert sorted((r["dcp"], r["batch"]) for r in written) == [(1, 1), (1, 2), (2, 1), (2, 2)]
    for r in written:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["kind"] == "qwen3" and r["tp"] == 2 and r["context_len"] == 40 and r["tpot_ms"] > 0
        assert r["lowering"] == "aot_eager" and not r["recompiled_in_timed_steps"]
        # Per-rank tokens cover the context plus the decoded tokens.
        assert r["max_context_tokens_per_rank"] * r["dcp"] >= 40 + 2
    by = {(r["dcp"], r["batch"]): r for r in written}
    for b in (1, 2):
        # 42 tokens: 3 pages of 16 at dcp=1, 2 virtual blocks of 32 (2 pages of 16 per rank) at dcp=2.
        assert by[(2, b)]["kv_cache_bytes_per_rank"] * 3 == by[(1, b)]["kv_cache_bytes_per_rank"] * 2
        assert by[(1, b)]["comm_bytes_per_step"] == 0 and by[(2, b)]["comm_bytes_per_step"] > 0
        assert by[(1, b)]["tp_allreduce_bytes_per_step"] == by[(2, b)]["tp_allreduce_bytes_per_step"] > 0
    assert (tmp_path / "bench_decode.png").stat().st_size > 0
