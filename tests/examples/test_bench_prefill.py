"""`examples/bench_prefill.py` end to end at a minimal size (aot_eager, one tiny world of 2 ranks)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from examples import bench_prefill
from examples.bench.args import parse_prefill_args
from examples.bench.profile import CATEGORIES
from examples.bench.shapes import PRESETS

REQUIRED = ("kind", "shape", "tp", "dcp", "merge", "world", "batch", "variant", "prompt_len", "context_len",
            "new_tokens", "ttft_ms", "ttft_min_ms", "ttft_mean_ms", "step_ms", "ttft_ratio_paired",
            "prefill_tokens_per_s", "kv_cache_bytes_per_rank", "comm_bytes_per_step", "tp_allreduce_bytes_per_step",
            "graphs_compiled", "recompiles_after_warmup", "breakdown_ms", "collectives_per_layer", "lowering", "dtype")


def test_bench_prefill_minimal(tmp_path: Path) -> None:
    rows = bench_prefill.main(["--tp", "2", "--dcp", "2", "--prompt", "24,40", "--prefix", "16", "--batch", "2",
                               "--steps", "1", "--warmup", "1", "--profile-steps", "1", "--lowering", "aot_eager",
                               "--out", str(tmp_path)])
    written = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert written == json.loads(json.dumps(rows))
    # Per prompt: the whole prompt from an empty cache, and the chunk after a 16-token cached prefix;
    # each at dcp = 1 (the baseline, added even when not asked for) and dcp = 2.
    assert sorted((r["prompt_len"], r["context_len"], r["dcp"]) for r in written) == [
        (p, c, d) for p in (24, 40) for c in (0, 16) for d in (1, 2)]
    for r in written:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["kind"] == "qwen3" and r["shape"] == "tiny" and r["tp"] == 2 and r["batch"] == 2
        assert r["world"] == [2, "ag_rs"] and r["lowering"] == "aot_eager" and r["ttft_ms"] > 0
        assert r["variant"] == ("chunked" if r["context_len"] else "full")
        assert r["new_tokens"] == r["prompt_len"] - r["context_len"]
        # Every world compiles one graph per side, and nothing after the warm-up step.
        assert r["graphs_compiled"] == 1 and r["recompiles_after_warmup"] == 0
        assert not r["recompiled_in_timed_steps"]
        assert set(CATEGORIES) <= set(r["breakdown_ms"]) and r["attention_ms"] > 0
        assert r["collectives_per_layer"] == {"dcp": 0 if r["dcp"] == 1 else 3, "tp": 2}
        assert (r["ttft_ratio_paired"] is None) == (r["dcp"] == 1)
    by = {(r["prompt_len"], r["context_len"], r["dcp"]): r for r in written}
    for p in (24, 40):
        for c in (0, 16):
            base, dcp = by[(p, c, 1)], by[(p, c, 2)]
            assert base["comm_bytes_per_step"] == 0 < dcp["comm_bytes_per_step"]
            assert base["tp_allreduce_bytes_per_step"] == dcp["tp_allreduce_bytes_per_step"] > 0
            assert dcp["kv_cache_bytes_per_rank"] < base["kv_cache_bytes_per_rank"]
    assert (tmp_path / "bench_prefill.png").stat().st_size > 0


@pytest.mark.slow  # each ~50-60 s here (a world per variant); test_bench_prefill_minimal stays default
def test_bench_prefill_sfa(tmp_path: Path) -> None:
    """SFA (`(latent, index_cache)` per layer): the cached prefix is also written into the
    replicated indexer cache; one world at dcp == tp, compiled once per side."""
    rows = bench_prefill.main(["--model", "sfa", "--tp", "2", "--dcp", "2", "--prompt", "40", "--prefix", "16",
                               "--batch", "1", "--steps", "1", "--warmup", "1", "--profile-steps", "1",
                               "--lowering", "aot_eager", "--out", str(tmp_path)])
    assert sorted((r["context_len"], r["dcp"]) for r in rows) == [(0, 1), (0, 2), (16, 1), (16, 2)]
    for r in rows:
        assert r["kind"] == "sfa" and r["graphs_compiled"] == 1 and r["recompiles_after_warmup"] == 0
        assert r["attention_ms"] > 0 and r["collectives_per_layer"]["dcp"] == (0 if r["dcp"] == 1 else 3)


def test_prefill_args() -> None:
    args = parse_prefill_args(["--prompt", "4096,1024", "--prefix", "2048", "--shape", "qwen3-235b-a22b-tp8"])
    assert args.prompt == (1024, 4096) and args.model == "qwen3" and args.dcp == (1, 2)
    # A prefix as long as a prompt leaves nothing to prefill: that prompt runs whole only.
    assert args.chunks(1024) == (0,) and args.chunks(4096) == (0, 2048)
    assert args.out == "results/bench_prefill"
    with pytest.raises(SystemExit):
        parse_prefill_args(["--prompt", "1024", "--prefix", "1024"])
    # SFA DCP runs at dcp == tp; the V3.2 preset is R1's per-rank MLA plus the indexer.
    with pytest.raises(SystemExit):
        parse_prefill_args(["--model", "sfa", "--tp", "4", "--dcp", "2"])
    v32 = PRESETS["deepseek-v32-tp8"].model_config(tp=2)
    assert (v32.num_heads // 2, v32.kv_lora_rank, v32.index_n_heads, v32.index_topk) == (16, 512, 64, 2048)


@pytest.mark.slow  # each ~50-60 s here (a world per variant); test_bench_prefill_minimal stays default
def test_bench_prefill_dsa_cp(tmp_path: Path) -> None:
    """--dsa-cp: one dcp = 1 world, DSA-CP off (plain TP) and on side by side, each compiled once;
    the on row carries the paired TTFT ratio and the all-to-all bytes of the formula."""
    rows = bench_prefill.main(["--model", "sfa", "--tp", "2", "--dsa-cp", "--prompt", "40", "--prefix", "16",
                               "--batch", "1", "--steps", "1", "--warmup", "1", "--profile-steps", "1",
                               "--lowering", "aot_eager", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert written == json.loads(json.dumps(rows))
    assert sorted((r["context_len"], r["dsa_cp"]) for r in rows) == [(0, False), (0, True), (16, False), (16, True)]
    for r in rows:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["kind"] == "sfa" and r["dcp"] == 1 and r["world"] == [1, "dsa_cp"]
        assert r["graphs_compiled"] == 1 and r["recompiles_after_warmup"] == 0  # DSA-CP: the prefill graph only
        assert r["merge"] == ("dsa_cp" if r["dsa_cp"] else "none") and r["attention_ms"] > 0
        assert (r["ttft_ratio_paired"] is None) == (not r["dsa_cp"])
        if r["dsa_cp"]:
            # Two all-to-alls per layer (Q in, output back); other DSA-CP passes may add their own.
            assert r["collectives_per_layer"]["dcp"] >= 2
            assert r["comm_bytes_per_step"] > 0
        else:
            assert r["collectives_per_layer"] == {"dcp": 0, "tp": 2} and r["comm_bytes_per_step"] == 0
    # The formula: tp 2, T = 40 or 24 tokens, 4 heads of latent 32 + rope 8, fp32, 2 layers.
    on = {r["context_len"]: r for r in rows if r["dsa_cp"]}
    for prefix, tokens in ((0, 40), (16, 24)):
        assert on[prefix]["comm_bytes_per_step"] == 2 * (1 * tokens * 4 * (2 * 32 + 8) * 4 // 4)
    assert (tmp_path / "bench_prefill.png").stat().st_size > 0


def test_prefill_args_dsa_cp() -> None:
    args = parse_prefill_args(["--model", "sfa", "--dsa-cp", "--prompt", "64"])
    assert args.dsa_cp and args.dcp == (1,) and args.worlds == ((1, "dsa_cp"),)
    assert parse_prefill_args(["--shape", "deepseek-v32-tp8", "--dsa-cp"]).model == "sfa"
    for bad in (["--dsa-cp"], ["--model", "mla", "--dsa-cp"], ["--model", "sfa", "--dsa-cp", "--dcp", "2"],
                ["--model", "sfa", "--dsa-cp", "--tp", "1", "--dcp", "1"]):
        with pytest.raises(SystemExit):
            parse_prefill_args(bad)


@pytest.mark.slow  # each ~50-60 s here (a world per variant); test_bench_prefill_minimal stays default
def test_bench_prefill_pcp(tmp_path: Path) -> None:
    """--pcp 2 at tp 1: one world of 2 ranks, the pcp = 1 baseline (plain lowering, every rank the whole
    prompt) and PCP (token-sharded prefill graph) side by side, one request of a small prompt, with and
    without a cached prefix (written at N = pcp)."""
    rows = bench_prefill.main(["--tp", "1", "--pcp", "2", "--prompt", "40", "--prefix", "16", "--batch", "1",
                               "--steps", "1", "--warmup", "1", "--profile-steps", "1", "--lowering", "aot_eager",
                               "--out", str(tmp_path)])
    written = json.loads((tmp_path / "bench_prefill.json").read_text())
    assert written == json.loads(json.dumps(rows))
    assert sorted((r["context_len"], r["pcp"]) for r in written) == [(0, 1), (0, 2), (16, 1), (16, 2)]
    for r in written:
        assert all(k in r for k in REQUIRED), sorted(set(REQUIRED) - set(r))
        assert r["kind"] == "qwen3" and r["tp"] == 1 and r["dcp"] == 1 and r["world"] == [1, "pcp"]
        assert r["merge"] == ("pcp" if r["pcp"] == 2 else "none") and r["ttft_ms"] > 0
        # One prefill graph per side, nothing compiled after the warm-up step. PCP: the fresh-step graph at
        # prefix 0 (measured first), then the general prefill graph for the step on a cached prefix.
        assert r["graphs_compiled"] == (2 if r["pcp"] == 2 and r["context_len"] else 1), r
        assert r["recompiles_after_warmup"] == 0
        assert set(CATEGORIES) <= set(r["breakdown_ms"]) and r["attention_ms"] > 0
        assert len(r["breakdown_ms_per_rank"]) == 2
        if r["pcp"] == 2:
            assert r["ttft_ratio_paired"] > 0 and r["comm_bytes_per_step"] is None
            # Per layer: K/V gather, Q gather, LSE merge AG + RS over PCP (all-gathers / reduce-scatters),
            # plus per forward the token-index and logits gathers; no TP all-reduce at tp 1. Without a
            # cached prefix (the fresh-step graph, issue 26) only the K/V gather per layer.
            per_layer = r["collectives_per_layer"]["dcp"]
            fresh = 1 + 2 / r["num_layers"]
            assert (per_layer >= 4) if r["context_len"] else per_layer == fresh, (r["collectives_per_layer"], fresh)
            assert r["collectives_per_layer"]["tp"] == 0
            assert r["breakdown_ms"]["dcp_comm"] > 0
        else:
            assert r["ttft_ratio_paired"] is None
            assert r["collectives_per_layer"] == {"dcp": 0, "tp": 0} and r["breakdown_ms"]["dcp_comm"] == 0
    by = {(r["context_len"], r["pcp"]): r for r in written}
    for prefix in (0, 16):
        # The cache is sharded over the 2 PCP ranks: half the pages' bytes per rank for the same tokens.
        assert by[(prefix, 2)]["kv_cache_bytes_per_rank"] < by[(prefix, 1)]["kv_cache_bytes_per_rank"]
    assert (tmp_path / "bench_prefill.png").stat().st_size > 0


def test_prefill_args_pcp() -> None:
    args = parse_prefill_args(["--tp", "1", "--pcp", "2", "--prompt", "8192"])
    assert args.pcp == 2 and args.ranks == 2 and args.dcp == (1,) and args.worlds == ((1, "pcp"),)
    assert parse_prefill_args(["--tp", "2"]).ranks == 2  # no --pcp: the world is tp
    for bad in (["--pcp", "0"], ["--tp", "2", "--pcp", "2", "--dcp", "2"], ["--model", "sfa", "--pcp", "2"],
                ["--model", "sfa", "--tp", "2", "--dsa-cp", "--pcp", "2"]):
        with pytest.raises(SystemExit):
            parse_prefill_args(bad)
