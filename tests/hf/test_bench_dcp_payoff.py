"""The DCP payoff benchmark's smallest configuration (examples/bench_dcp_payoff.py).

Tiny Qwen3 (1 KV head) at tp 2 through `cp_compile.LLM` on spawned gloo ranks, the
same `kv_cache_memory_bytes` per rank (two requests of max_model_len at dcp 1),
dcp 1 then dcp 2. Every request arrives at once with the same length, so admission
is by KV blocks alone: dcp 2 runs exactly 2x the requests of dcp 1 at once
(deterministic). Speeds are only checked to be present and positive (benchmarks
measure, tests do not time).
"""

from __future__ import annotations

import json

import pytest

from examples.bench_dcp_payoff import main

ROW_FIELDS = ("max_concurrent", "output_tok_s", "decode_tok_s", "ttft_median_s", "ttft_p99_s", "tpot_median_s", "tpot_p99_s",
              "kv_trace", "tokens_per_group", "max_concurrency_at_max_model_len", "per_run")


def test_smallest_config_json_and_dcp2_admits_twice(tmp_path):
    out = tmp_path / "payoff.json"
    main(["--shape", "tiny", "--runs", "1", "--requests", "6", "--prompt", "24,24", "--output", "8,8",
          "--interval", "0", "--block-size", "4", "--ckpt-dir", str(tmp_path), "--out", str(out)])
    (res,) = json.loads(out.read_text())
    one, two = res["dcp"]
    assert (one["dcp"], two["dcp"]) == (1, 2)
    for row in (one, two):
        for k in ROW_FIELDS:
            assert k in row, k
        assert row["kv_cache_memory_bytes"] == res["kv_cache_memory_bytes"]
        assert row["output_tokens"] == 6 * 8  # every request ran to its max_tokens
        assert row["output_tok_s"] > 0 and row["ttft_p99_s"] >= row["ttft_median_s"] >= 0
        assert row["max_concurrent_spread"] == [row["max_concurrent"]] * 2
        # Each request in a step makes one token: the steps' batches add up to the outputs
        # (what the decode-only tokens/s counts on).
        assert sum(p[2] for p in row["kv_trace"]) == row["output_tokens"]
        assert row["decode_tok_s"] > 0
        used = [p[1] for p in row["kv_trace"]]
        assert 0 < max(used) <= 1.0
    # The same bytes: the same blocks, twice the tokens per DCP group, twice the admitted requests.
    assert one["num_blocks"] == two["num_blocks"]
    assert two["tokens_per_group"] == 2 * one["tokens_per_group"]
    assert (one["max_concurrency_at_max_model_len"], two["max_concurrency_at_max_model_len"]) == (2, 4)
    assert (one["max_concurrent"], two["max_concurrent"]) == (2, 4)
    # KV usage at the peak: 2 requests x 8 blocks at dcp 1, 4 x 4 at dcp 2: the whole 16-block pool.
    assert max(p[1] for p in one["kv_trace"]) == max(p[1] for p in two["kv_trace"]) == 1.0


@pytest.mark.slow  # ~35 s: a producer and two consumer LLMs (6 ranks) on 2 cores
def test_pd_decode_instance_rows(tmp_path):
    """`--pd --no-colocated`: the trace's prompts prefilled by a producer LLM and imported over
    NIXL by each decode instance; the rows have the colocated rows' fields, and the decode
    instance's admission is its pool's (2 vs 4 at once from the same bytes)."""
    out = tmp_path / "pd.json"
    main(["--shape", "tiny", "--runs", "1", "--requests", "6", "--prompt", "24,24", "--output", "8,8",
          "--interval", "0", "--block-size", "4", "--ckpt-dir", str(tmp_path), "--out", str(out),
          "--pd", "--no-colocated"])
    (res,) = json.loads(out.read_text())
    assert res["dcp"] == []
    one, two = res["pd"]
    for row in (one, two):
        for k in ROW_FIELDS:
            assert k in row, k
        assert row["role"] == "decode instance (P/D)" and len(row["producer_prefill_s"]) == 1
        assert row["output_tokens"] == 6 * 8
        # The first token of each request is the producer's (imported with the KV): D's steps make the other 7.
        assert sum(p[2] for p in row["kv_trace"]) == 6 * 7
    assert (one["max_concurrency_at_max_model_len"], two["max_concurrency_at_max_model_len"]) == (2, 4)
    assert (one["max_concurrent"], two["max_concurrent"]) == (2, 4)
