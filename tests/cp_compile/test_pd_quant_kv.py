"""PD disaggregation with a quantised KV cache (issue 39, decisions 65 and 67): the codes
and their fp32 scales move from the prefill instance to the decode instance of another
layout, and D's greedy decode equals one device with the same quantised cache; P and D
with different kv_cache_dtype are refused before any byte moves.

The harness is examples/pd_disagg.py's (two process worlds, NIXL UCX over DRAM, a
TCPStore). Default: one pair of worlds (P 2 ranks, D 1 rank: both eager, no dynamo
trace), the exact case and the refusal. `slow`: the DCP layouts (P dcp 2 token
interleave -> D dcp 1, MLA P dcp 1 -> D dcp 2 whole blocks), fp8 and int8, and a PCP
prefill instance P(tp1,pcp2) -> D(tp2,dcp2)."""

from __future__ import annotations

import pytest

from cp_compile.serving.kv_transfer import KVLayout
from cp_compile.serving.kv_transfer.plan import expected_rank_bytes
from examples.pd_disagg import Case, Side, compare, geometry_of, reference, run_cases

# D's decode against one device with the same quantised cache: tolerance, not bits (the
# P ranks' TP-split projections round differently from the single device's)
LOGIT_TOL = 1e-4

DEFAULT = [
    # P one KV head per rank (tp 2) -> D both heads (tp 1), blocks of 4 -> 8: per-token
    # head-subset reads of the codes and of the scales
    Case("gqa", Side(2, 1, 1, 1, 4, "int8"), Side(1, 1, 1, 1, 8, "int8"), num_kv_heads=2),
    Case("gqa", Side(2, 1, 1, 1, 4, "fp8_e4m3"), Side(1, 1, 1, 1, 8, "int8"), num_kv_heads=2, prompt_lens=(13,),
         fault="dtype"),
]
SLOW = [
    Case("gqa", Side(2, 1, 2, 1, 4, "fp8_e4m3"), Side(2, 1, 1, 1, 8, "fp8_e4m3")),  # token path, staged reads
    Case("mla", Side(2, 1, 1, 4, 4, "int8"), Side(2, 1, 2, 4, 4, "int8")),  # whole blocks into D's DCP ranks
    Case("mla", Side(2, 1, 2, 1, 4, "fp8_e4m3"), Side(2, 1, 1, 4, 8, "fp8_e4m3")),
    # a PCP prefill instance (decision 68) -> D at dcp 2: the P(tp1,pcp2) -> D(tp2,dcp2)
    Case("gqa", Side(1, 2, 1, 1, 4, "int8"), Side(2, 1, 2, 1, 4, "int8")),
    # SFA (decision 69): the int8 latent and its scales dealt to D's DCP ranks, the replicated
    # indexer's keys (model dtype) to every D rank: P tp 2, dcp 2 -> D tp 2, dcp 1, blocks 4 -> 8
    Case("sfa", Side(2, 1, 2, 1, 4, "int8"), Side(2, 1, 1, 1, 8, "int8")),
]


def _per_case(outs, i):
    return [rank_outs[i] for rank_outs in outs]


def _check_exact(cases, p, d, models, i):
    case = cases[i]
    geo = geometry_of(*models[i], case.p.kv_cache_dtype)
    res = compare(case, reference(case, *models[i]), _per_case(p, i), _per_case(d, i), geo)
    print(f"\n{case.name()}: tokens equal {res['equal']}, max logit diff {res['max_logit_diff']:.1e}, "
          f"bytes {res['bytes']} (formula {res['formula']})")
    assert res["equal"], case.name()
    assert res["max_logit_diff"] < LOGIT_TOL, res["max_logit_diff"]
    assert res["bytes"] == res["formula"]
    assert set(res["verdicts"].values()) == {"ok"}
    layout = KVLayout.from_config(case.d.config())
    for o in _per_case(d, i):  # each D rank read its tokens' codes and scales, nothing else
        want = sum(expected_rank_bytes(geo, layout, n, o["rank"]) for n in case.prompt_lens)
        assert sum(imp.bytes_moved for imp in o["imported"].values()) == want
        nonzero = o["cache_nonzero"]  # per tensor: k, v, k_scale, v_scale of each layer (MLA: latent, scale)
        assert all(c > 0 for c in nonzero), nonzero  # the scales arrived with the codes


def _run(cases):
    p, d, models = run_cases(cases, timeout=900.0)
    for out in (p, d):
        if isinstance(out, BaseException):
            raise out
    return p, d, models


def test_quantised_pd_decode_equals_single_device_and_dtype_mismatch_refused():
    cases = DEFAULT
    p, d, models = _run(cases)
    _check_exact(cases, p, d, models, 0)
    # the refusal: before anything is allocated or moved, naming the field, both values and the fix
    i = 1
    for o in _per_case(d, i):
        print(f"\ndtype mismatch, D rank {o['rank']}: {o['error']}")
        assert o["error"].startswith("ConfigError"), o["error"]
        assert "kv_cache_dtype: prefill 'fp8_e4m3', decode 'int8'" in o["error"], o["error"]
        assert "Fix: start the decode instance with CPConfig(kv_cache_dtype='fp8_e4m3')" in o["error"], o["error"]
        assert sum(o["cache_nonzero"]) == 0  # nothing moved
        assert o["free"] == o["num_blocks"]  # nothing allocated
    assert _per_case(p, i)[0]["verdicts"][0].startswith("refused: ")


@pytest.mark.slow
def test_quantised_pd_between_dcp_layouts_sweep():
    cases = SLOW
    p, d, models = _run(cases)
    bad = []
    for i in range(len(cases)):
        try:
            _check_exact(cases, p, d, models, i)
        except AssertionError as exc:
            bad.append(f"{cases[i].name()}: {exc}")
    assert not bad, bad
