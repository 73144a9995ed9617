"""PD disaggregation end to end: two separate process worlds (P and D, each its own
init_parallel and process groups), NIXL (UCX, DRAM) between them, a TCPStore both
reach. D's greedy tokens must equal a single-device run over the whole prompt, the
bytes moved must equal the formula, and the faults must fail the way the connector
promises. One pair of worlds (2 + 2 ranks) serves every default case, the rank death
last (its P world loses a rank; the earlier cases' P results are saved per case)."""

from __future__ import annotations

import os

import pytest
import torch

from cp_compile.serving.kv_transfer import KVLayout
from cp_compile.serving.kv_transfer.plan import expected_rank_bytes
from cp_compile.testing.multirank import RankFailed
from examples.pd_disagg import Case, Side, compare, geometry_of, reference, run_cases

# Default: each distinct path once, one dynamo trace per case (the traces are the cost):
# - token path: P at pcp 2 deals tokens one by one, D at dcp 1 holds them all in
#   blocks of 4 (PCP prefill export; staged reads scattered into D's slots), GQA;
# - block path: P at dcp 1, D at dcp 2 with interleave == block_size, equal block
#   sizes: every planned run is a whole block (D-side CP ownership and decode), MLA.
# P at dcp 2 -> D at dcp 1 (token interleave, block sizes 4 -> 8) runs through the LLM
# roles (tests/entrypoints/test_llm_pd_disagg.py, default); SFA's latent and indexer
# move in the ownership fault below (D never runs its model there); the wide matrix,
# the P(tp1,pcp2) -> D(tp2,dcp2) included, is `slow`.
EXACT = [
    Case("gqa", Side(1, 2, 1, 1, 4), Side(2, 1, 1, 1, 4)),  # P(tp1,pcp2) -> D(tp2,dcp1), token path
    Case("mla", Side(2, 1, 1, 4, 4), Side(2, 1, 2, 4, 4)),  # P(tp2,dcp1) -> D(tp2,dcp2), block path
]
# Fault cases: D never runs its model except in "stall" (dcp 1: eager). "kill" is last.
FAULTS = [
    Case("gqa", Side(2, 1, 1, 1, 4), Side(2, 1, 2, 1, 4), prompt_lens=(13,), fault="mismatch"),
    Case("sfa", Side(2, 1, 1, 1, 4), Side(2, 1, 1, 1, 8), prompt_lens=(13,), fault="ownership"),
    Case("gqa", Side(2, 1, 1, 1, 4), Side(2, 1, 1, 1, 8), prompt_lens=(13, 6), fault="stall", timeout_s=3.0),
    Case("gqa", Side(2, 1, 1, 1, 4), Side(2, 1, 1, 1, 8), prompt_lens=(13,), fault="kill", timeout_s=30.0),
]


# Under `slow` (each group is one pair of worlds): KV heads split differently on the
# two sides (2 KV heads), the remaining interleave / block-size directions, MLA and SFA
# from the other layouts, and a one-rank decode instance.
SLOW = [
    [Case("gqa", Side(2, 1, 2, 1, 4), Side(2, 1, 1, 1, 8)),  # P(tp2,dcp2) -> D(tp2,dcp1), block sizes 4 -> 8
     Case("gqa", Side(1, 2, 1, 1, 4), Side(2, 1, 2, 1, 4)),  # P(tp1,pcp2) -> D(tp2,dcp2)
     Case("gqa", Side(2, 1, 1, 4, 4), Side(2, 1, 2, 4, 4)),  # P(tp2,dcp1) -> D(tp2,dcp2), block interleave
     Case("mla", Side(2, 1, 2, 4, 4), Side(2, 1, 1, 1, 4)),  # block_size -> D dcp 1
     Case("mla", Side(2, 1, 2, 1, 4), Side(2, 1, 2, 4, 4)),  # interleave 1 -> block_size
     Case("sfa", Side(2, 1, 2, 4, 4), Side(2, 1, 1, 1, 8)),  # block_size -> 1, block sizes 4 -> 8, indexer
     Case("gqa", Side(1, 2, 1, 1, 4), Side(2, 1, 1, 2, 8), num_kv_heads=2),  # P both heads -> D one head/rank
     Case("gqa", Side(2, 1, 2, 4, 4), Side(2, 1, 1, 1, 4)),  # block_size -> interleave 1
     Case("mla", Side(1, 2, 1, 1, 4), Side(2, 1, 2, 4, 4)),
     Case("mla", Side(2, 1, 1, 4, 4), Side(2, 1, 2, 1, 8)),
     Case("sfa", Side(2, 1, 1, 1, 4), Side(2, 1, 2, 4, 4))],
    [Case("gqa", Side(2, 1, 1, 1, 4), Side(1, 1, 1, 1, 8), num_kv_heads=2),  # P one head/rank -> D both
     Case("mla", Side(2, 1, 2, 1, 4), Side(1, 1, 1, 4, 4)),
     Case("sfa", Side(2, 1, 2, 1, 4), Side(1, 1, 1, 1, 8))],
]


@pytest.mark.slow
@pytest.mark.parametrize("group", range(len(SLOW)))
def test_decode_equals_single_device_sweep(group):
    cases = SLOW[group]
    p, d, models = run_cases(cases)
    for out in (p, d):
        if isinstance(out, BaseException):
            raise out
    bad = []
    for i, case in enumerate(cases):
        res = compare(case, reference(case, *models[i]), _per_case(p, i), _per_case(d, i), geometry_of(*models[i]))
        print(f"\n{case.name()}: tokens equal {res['equal']}, max logit diff {res['max_logit_diff']:.1e}, "
              f"bytes {res['bytes']} (formula {res['formula']})")
        if not (res["equal"] and res["max_logit_diff"] < 1e-4 and res["bytes"] == res["formula"]):
            bad.append(case.name())
    assert not bad, bad


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    cases = EXACT + FAULTS
    saved = tmp_path_factory.mktemp("pd_p")
    # timeout: a deadlock guard (6 cases took ~600 s at load 30 on 2 cores).
    p, d, models = run_cases(cases, timeout=1200.0, save_dir=str(saved))
    if isinstance(d, BaseException):
        raise d
    # The last case kills P rank 1, so the P world fails (RankFailed naming rank 1);
    died = p
    if not isinstance(died, RankFailed):
        raise AssertionError(f"the prefill world should have lost rank 1, got {died!r}")
    # every case before it saved each P rank's results (rank 0 may have saved the last too).
    p = [torch.load(os.path.join(saved, f"p{r}.pt"), weights_only=False)[:len(cases) - 1] for r in range(2)]
    assert all(len(outs) == len(cases) - 1 for outs in p), [len(outs) for outs in p]
    return cases, p, d, models, died


def _per_case(outs, i):
    return [rank_outs[i] for rank_outs in outs]


@pytest.mark.parametrize("i", range(len(EXACT)), ids=[c.name() for c in EXACT])
def test_decode_equals_single_device(matrix, i):
    cases, p, d, models, _ = matrix
    case = cases[i]
    ref = reference(case, *models[i])
    res = compare(case, ref, _per_case(p, i), _per_case(d, i), geometry_of(*models[i]))
    print(f"\n{case.name()}: tokens equal {res['equal']}, max logit diff {res['max_logit_diff']:.1e}, "
          f"bytes {res['bytes']} (formula {res['formula']})")
    assert res["equal"], case.name()
    assert res["max_logit_diff"] < 1e-4
    assert res["bytes"] == res["formula"]
    assert set(res["verdicts"].values()) == {"ok"}
    assert all(o["free"] == 24 for o in _per_case(p, i))  # the producer freed every block after the verdict
    layout = KVLayout.from_config(case.d.config())
    for o in _per_case(d, i):  # each D rank read only what it owns (its cp rank's tokens, its heads)
        want = sum(expected_rank_bytes(geometry_of(*models[i]), layout, n, o["rank"]) for n in case.prompt_lens)
        assert sum(imp.bytes_moved for imp in o["imported"].values()) == want


def test_model_mismatch_refused_before_any_byte(matrix):
    cases, p, d, models, _ = matrix
    i = cases.index(FAULTS[0])
    print(f"\nmismatch, D rank 0: {_per_case(d, i)[0]['error']}")
    for o in _per_case(d, i):
        assert "num_layers: prefill 2, decode 3" in o["error"] and o["error"].startswith("ConfigError")
        assert sum(o["cache_nonzero"]) == 0  # nothing moved
        assert o["free"] == o["num_blocks"]  # nothing allocated
    assert _per_case(p, i)[0]["verdicts"][0].startswith("refused: ")


def test_transfer_into_dropped_blocks_impossible(matrix):
    """The request is dropped after layer 0 and its blocks handed to another request:
    the next layer's reads are refused (KVOwnershipError) on every D rank; layer 1 of
    the cache is untouched."""
    cases, p, d, models, _ = matrix
    i = cases.index(FAULTS[1])
    print(f"\nownership, D rank 0: {_per_case(d, i)[0]['error']}")
    for o in _per_case(d, i):
        assert o["ownership"] and "owns" in o["error"], o["error"]
        layer0, layer1 = o["layer_nonzero"]
        latent0, index0 = o["cache_nonzero"][:2]  # SFA: layer 0's latent and its replicated indexer arrived
        assert layer0 > 0 and latent0 > 0 and index0 > 0 and layer1 == 0
    assert _per_case(p, i)[0]["verdicts"][0].startswith("failed: ")


def test_prefill_rank_death_mid_transfer(matrix):
    """P rank 1 is SIGKILLed once layer 0 arrived. P holds every token on both ranks
    (dcp 1), so D rank 0 reads from P rank 0 and D rank 1 from P rank 1: D rank 1's
    read of layer 1 fails with the producer rank named, D rank 0 (whose reads all
    succeed) fails the request too (the consumer ranks agree), both well within
    transfer_timeout_s, and both free the request's blocks."""
    cases, p, d, models, died = matrix
    i = cases.index(FAULTS[3])
    case = cases[i]
    assert died.root == 1, died
    d0, d1 = _per_case(d, i)
    for o in (d0, d1):
        print(f"\nrank death, D rank {o['rank']} after {o['seconds']:.2f} s: {o['error']}")
    assert "the read of layer 1 from producer rank 1" in d1["error"] or \
        "posting the read of layer 1 from producer rank 1" in d1["error"], d1["error"]
    assert "another consumer rank's reads failed" in d0["error"], d0["error"]
    for o in (d0, d1):
        assert o["error"].startswith("KVTransferError") and "decode blocks were freed" in o["error"]
        assert o["seconds"] < case.timeout_s
        assert o["free"] == o["num_blocks"]
    assert d1["layer_nonzero"][0] > 0 and d1["layer_nonzero"][1] == 0  # layer 0 arrived, layer 1 did not


def test_stalled_prefill_rank_fails_the_request_and_the_next_is_served(matrix):
    """P rank 1 prefills request 0 but never reports it ready (alive, hung): every D rank
    fails request 0 with a KVTransferError naming the request and the silent rank,
    within transfer_timeout_s of P rank 0's report; nothing was written into D's cache
    and no D block is held; P gets the verdict and frees its blocks; request 1 then
    decodes exactly as on one device."""
    cases, p, d, models, _ = matrix
    i = cases.index(FAULTS[2])
    case = cases[i]
    ref = reference(case, *models[i])
    for o in _per_case(d, i):
        print(f"\nstall, D rank {o['rank']} after {o['seconds']:.2f} s: {o['error']}")
        assert o["error"].startswith("KVTransferError: request 0:"), o["error"]
        assert "producer rank(s) [1] did not report it ready within transfer_timeout_s=3.0" in o["error"]
        assert "decode blocks were freed" in o["error"]
        assert case.timeout_s - 0.5 < o["seconds"] < case.timeout_s + 5.0  # timed from P rank 0's report
        assert sum(o["cache_nonzero_after_fault"]) == 0 and o["free_after_fault"] == o["num_blocks"]
        assert o["tokens"][1] == ref["tokens"][1]  # the next request is served
        assert o["imported"][1].bytes_moved > 0
    verdicts = _per_case(p, i)[0]["verdicts"]
    assert verdicts[0].startswith("failed: request 0") and verdicts[1] == "ok", verdicts
    assert all(o["free"] == 24 for o in _per_case(p, i))


def test_example_refuses_a_bad_layout(capsys):
    """examples/pd_disagg.py with a layout the model cannot serve (P dcp 3 over tp 2, one
    KV head) exits 2 before any process starts, naming the side, the rule and the fix."""
    from examples.pd_disagg import main

    assert main(["--p-tp", "2", "--p-dcp", "3", "--d-tp", "2", "--d-dcp", "1"]) == 2
    err = capsys.readouterr().err
    assert "the prefill layout tp2,dcp3,I1,bs4 is refused" in err and "decode_context_parallel_size=3" in err
    assert "Fix:" in err
