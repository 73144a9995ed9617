"""`examples/bench_decode.py` end to end at a minimal size (aot_eager, two tiny worlds, one batch size: a
second batch size adds graphs, not paths), and its presets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples import bench_decode
from examples.bench.args import parse_args
from examples.bench.profile import CATEGORIES
from examples.bench.shapes import PRESETS

REQUIRED = ("kind", "tp", "dcp", "interleave", "batch", "context_len", "tpot_ms", "kv_cache_bytes_per_rank",
            "max_context_tokens_per_rank", "comm_bytes_per_step", "tp_allreduce_bytes_per_step", "lowering",
            "dtype", "merge")


def test_bench_decode_minimal(tmp_path: Path) -> None:
    rows = bench_decode.main(["--tp", "2", "--dcp", "2", "--context", "40", "--batch", "2", "--steps", "1",
                              "--warmup", "1", "--profile-steps", "1", "--lowering", "aot_eager",
                              "--out", str(tmp_path)])
    written = json.loads((tmp_path / "bench_decode.json").read_text())
    assert written == json.loads(json.dumps(rows))
    # dcp=1 (the TP baseline) is added even when not asked for.
    assert sorted((r["dcp"], r["batch"]) for r in written) == [(1, 2), (2, 2)]
    for r in written:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["kind"] == "qwen3" and r["tp"] == 2 and r["context_len"] == 40 and r["tpot_ms"] > 0
        assert r["lowering"] == "aot_eager" and not r["recompiled_in_timed_steps"]
        # Per-rank tokens cover the context plus the decoded tokens.
        assert r["max_context_tokens_per_rank"] * r["dcp"] >= 40 + 2
    by = {(r["dcp"], r["batch"]): r for r in written}
    for b in (2,):
        # 42 tokens: 3 pages of 16 at dcp=1, 2 virtual blocks of 32 (2 pages of 16 per rank) at dcp=2.
        assert by[(2, b)]["kv_cache_bytes_per_rank"] * 3 == by[(1, b)]["kv_cache_bytes_per_rank"] * 2
        assert by[(1, b)]["comm_bytes_per_step"] == 0 and by[(2, b)]["comm_bytes_per_step"] > 0
        assert by[(1, b)]["tp_allreduce_bytes_per_step"] == by[(2, b)]["tp_allreduce_bytes_per_step"] > 0
    assert (tmp_path / "bench_decode.png").stat().st_size > 0
    # Where the time goes: every category, and the collectives per layer of GQA + AG/RS.
    for r in written:
        assert r["recompiles_after_warmup"] == 0 and r["shape"] == "tiny" and r["world"] == [2, "ag_rs"]
        assert set(CATEGORIES) <= set(r["breakdown_ms"]) and r["attention_ms"] > 0
        assert r["collectives_per_layer"] == {"dcp": 0 if r["dcp"] == 1 else 3, "tp": 2}
        # The same KV budget holds dcp times the context.
        assert r["kv_budget_max_context"] == by[(1, r["batch"])]["kv_budget_max_context"] * r["dcp"]
    assert all(by[(2, b)]["compile_ratio"] > 0 and by[(1, b)]["compile_ratio"] is None for b in (2,))
    assert (tmp_path / "bench_decode_breakdown.png").stat().st_size > 0


def test_presets_reproduce_per_rank_attention() -> None:
    """At any tp, a rank of the preset attends like a rank of the deployment at tp 8."""
    qwen = PRESETS["qwen3-235b-a22b-tp8"].model_config(tp=2)
    assert (qwen.num_heads // 2, qwen.num_kv_heads, qwen.head_dim) == (8, 1, 128)
    r1 = PRESETS["deepseek-r1-tp8"].model_config(tp=4)
    assert (r1.num_heads // 4, r1.kv_lora_rank, r1.qk_rope_head_dim) == (16, 512, 64)
    args = parse_args(["--shape", "deepseek-r1-tp8", "--merge", "ag_rs,a2a", "--dcp", "2"])
    assert args.model == "mla" and args.worlds == ((2, "ag_rs"), (2, "a2a"))
    with pytest.raises(SystemExit):
        parse_args(["--shape", "deepseek-r1-tp8", "--model", "qwen3"])
