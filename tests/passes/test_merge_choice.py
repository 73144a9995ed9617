"""dcp_merge="auto": the cost model (cp_compile/base/merge_cost.py) and the per-graph choice of the DCP pass.

The choice on real ranks, exact against one device, is in
tests/passes/test_compiled_dcp_model.py (the "auto" case); here: the prediction is
the collectives' bytes under the measured costs, the cheaper merge is chosen and
lands in the graph and the pass history, an explicit merge is honoured, the
calibration agrees across ranks and is cached (checked in the "auto" world there).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import cp_compile
from cp_compile.base import merge_cost
from cp_compile.base.comm_stats import decode_comm_bytes_per_layer
from cp_compile.passes.context import CompileContext
from cp_compile.testing.pass_harness import run_pipeline
from tests.passes.test_pipeline import LAYERS, Attn, _ctx, _inputs

SIZES = dict(tokens=8, heads=8, q_dim=128, v_dim=128, dtype_bytes=4)


def costs(a2a_latency: float = 1e-5, spb: float = 1e-9) -> merge_cost.CollectiveCosts:
    lat = {"all_gather": 1e-5, "reduce_scatter": 1e-5, "all_to_all": a2a_latency}
    return merge_cost.CollectiveCosts(lat, {k: spb for k in lat}, group_size=2, backend="test")


def test_prediction_is_latency_plus_bytes() -> None:
    c = costs()
    for merge, calls in (("ag_rs", 3), ("a2a", 2)):
        want = calls * 1e-5 + 1e-9 * decode_comm_bytes_per_layer(8, 8, 128, 128, 4, 2, merge)
        assert merge_cost.predict(c, merge, **SIZES) == pytest.approx(want)


def test_the_cheaper_merge_is_chosen() -> None:
    # Same costs per kind: A2A has one collective and 4(N-1) LSE bytes less per head and token.
    assert merge_cost.choose(costs(), **SIZES).merge == "a2a"
    # An all-to-all with a large fixed cost (as gloo's pairwise exchange can have) loses at small batch ...
    slow_a2a = costs(a2a_latency=1e-3)
    small = merge_cost.choose(slow_a2a, **SIZES)
    assert small.merge == "ag_rs" and small.predicted_s["ag_rs"] < small.predicted_s["a2a"]
    # ... and wins once the bytes dominate (the AG+RS LSE gather grows with N per token).
    big = merge_cost.choose(dataclasses.replace(slow_a2a, group_size=8), **dict(SIZES, tokens=4096, v_dim=8))
    assert big.merge == "a2a"
    none = merge_cost.choose(None, **SIZES)
    assert none.merge == "ag_rs" and "no calibrated" in none.reason


def _auto_ctx(kind: str, c: merge_cost.CollectiveCosts | None, merge: str = "auto") -> CompileContext:
    return dataclasses.replace(_ctx(kind, 2, merge), collective_costs=c)


@pytest.mark.parametrize("kind,want", [("gqa", "a2a"), ("mla", "ag_rs")])
def test_the_pass_builds_the_chosen_merge_and_records_it(kind: str, want: str) -> None:
    c = costs() if want == "a2a" else costs(a2a_latency=1.0)
    pm, _ = run_pipeline(Attn(kind), _inputs(kind, 8), _auto_ctx(kind, c))
    rec = pm.history[0]
    assert rec.name == "dcp_attention" and rec.decision["merge"] == want
    assert set(rec.decision["predicted_s"]) == {"ag_rs", "a2a"}
    assert rec.decision["tokens"] > 0
    a2a_nodes = rec.after.get("_c10d_functional.all_to_all_single.default", 0)
    rs_nodes = rec.after.get("_c10d_functional.reduce_scatter_tensor.default", 0)
    assert (a2a_nodes, rs_nodes) == ((LAYERS, 0) if want == "a2a" else (0, LAYERS))


def test_an_explicit_merge_is_honoured() -> None:
    pm, _ = run_pipeline(Attn("gqa"), _inputs("gqa", 8), _auto_ctx("gqa", costs(a2a_latency=1.0), merge="a2a"))
    rec = pm.history[0]
    assert rec.decision == {"merge": "a2a", "reason": "explicit dcp_merge"}
    assert rec.after["_c10d_functional.all_to_all_single.default"] == LAYERS


def test_replicate_drops_the_query_gather_and_pays_the_projections() -> None:
    """Query replication (issue 26): the all-to-all alone, plus N - 1 query projections
    (weight bytes and flops at the calibrated matmul costs); a candidate of "auto" only
    where the graph's query chain is replicable (query_weights given)."""
    c = dataclasses.replace(costs(), matmul_s_per_weight_byte=1e-10, matmul_s_per_flop=1e-12)
    qw = merge_cost.QueryWeights(bytes=4 * 1024 * 4096, matrix_elements=1024 * 4096)
    a2a = merge_cost.predict(c, "a2a", **SIZES)
    q_gather = 1e-5 + 1e-9 * (2 - 1) * 8 * 8 * 128 * 4  # latency + bytes of the Q all-gather at N = 2
    matmul = (2 - 1) * (qw.bytes * 1e-10 + 2 * 8 * qw.matrix_elements * 1e-12)
    assert merge_cost.predict(c, "replicate", **SIZES, query_weights=qw) == pytest.approx(a2a - q_gather + matmul)
    cheap = merge_cost.choose(c, **SIZES, query_weights=merge_cost.QueryWeights(4096, 1024))
    assert cheap.merge == "replicate" and set(cheap.predicted_s) == set(merge_cost.MERGES)
    heavy = merge_cost.choose(dataclasses.replace(c, matmul_s_per_weight_byte=1e-6), **SIZES, query_weights=qw)
    assert heavy.merge == "a2a" and heavy.predicted_s["replicate"] > heavy.predicted_s["a2a"]
    without = merge_cost.choose(c, **SIZES)
    assert "replicate" not in without.predicted_s and "not replicable" in without.reason
    with pytest.raises(ValueError, match="query_weights"):
        merge_cost.predict(c, "replicate", **SIZES)


def test_replicate_refuses_queries_the_keys_are_computed_from() -> None:
    """The test model slices its keys out of its queries (as a fused QKV projection would
    give them): no chain computes the queries alone, so copying one per rank cannot be
    exact; an explicit "replicate" is a ConfigError naming why and the fix."""
    with pytest.raises(cp_compile.ConfigError, match="replicable query projection.*nothing computes the queries "
                       "alone.*dcp_merge='a2a'"):
        run_pipeline(Attn("gqa"), _inputs("gqa", 8), _auto_ctx("gqa", None, merge="replicate"))
