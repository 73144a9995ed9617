"""A failed or killed rank fails its peers fast, with the failed rank named.

Each world runs eager DCP decode steps (Q all-gather, local partial attention, LSE
merge: real gloo collectives on the DCP group) and one rank fails at step 3:
- it raises (its process exits): the peer's next collective loses the connection
  and raises at once; `RankFailed` names the raising rank as the root;
- it raises and stays alive without taking part (a server that caught the error):
  the peer raises after `init_parallel(timeout=...)`, not later;
- it is killed (SIGKILL): the peer raises at once and its error names the dead rank.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import cp_compile
from cp_compile.ops.parallel import dcp as D
from cp_compile.testing.multirank import RankFailed, run_on_ranks

BLOCK = 4
FAIL_STEP = 3
PG_TIMEOUT = 3.0  # the silent-peer world's collective timeout
FAST = 30.0  # the other worlds' timeout: a peer failing well within it did not time out


def _decode(rank: int, world: int, mode: str, timeout: float) -> dict:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=world, block_size=BLOCK)
    state = cp_compile.init_parallel(cfg, device="cpu", timeout=timeout)
    ctx = D.DCPContext(group=state.layout.cp, interleave=1, block_size=BLOCK)
    cache = cp_compile.allocate_kv_cache(cfg, cp_compile.KVCacheSpec(1, "gqa", head_dim=8, num_kv_heads_per_rank=1),
                                         8, attention=cp_compile.AttentionSpec("gqa", 2 * world, 1))
    k_cache, v_cache = cache.layers[0]
    alloc = cp_compile.BlockAllocator(8, cfg.virtual_block_size)
    g = torch.Generator().manual_seed(0)
    meta = cp_compile.build_attention_metadata([(0, 5)], alloc)
    t_fail = None
    for step in range(8):
        if step == FAIL_STEP and rank == 1:
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "raise":
                raise RuntimeError("rank one gives up mid-decode")
            if mode == "silent":
                # Raised and caught (as a server would), then away from the collectives.
                time.sleep(PG_TIMEOUT + 4)
                return {"slept": True}
        T = meta.num_tokens
        q, k, v = (torch.randn(T, h, 8, generator=g) for h in (2, 1, 1))
        t0 = time.monotonic()
        try:
            D.dcp_gqa_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, meta.block_table, meta.seq_lens,
                                meta.query_start_loc, 0.3, ctx)
        except Exception as exc:
            t_fail = time.monotonic() - t0
            if mode == "silent":
                return {"step": step, "after_s": t_fail, "error": f"{type(exc).__name__}: {exc}"}
            raise
        meta = cp_compile.build_attention_metadata([(int(meta.seq_lens[0]), 1)], alloc)
    return {"finished": True}


def test_raising_rank_fails_its_peer_fast_and_is_named_root():
    t0 = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_on_ranks(_decode, 2, "raise", FAST, timeout=120)
    exc = info.value
    assert exc.root == 1, str(exc)
    assert "rank one gives up mid-decode" in exc.failures[1]
    # The peer raised on its own (not killed by the harness), on the lost connection:
    # well before its 30 s collective timeout.
    assert 0 in exc.failures and exc.killed == [], str(exc)
    assert exc.times[0] - exc.times[1] < FAST / 3, str(exc)
    assert "peer rank 1 failed first: RuntimeError: rank one gives up mid-decode" in exc.failures[0]
    assert str(exc).startswith("rank 1 of 2 failed:")
    assert time.monotonic() - t0 < 90


def test_silent_peer_times_out_after_the_configured_timeout():
    res = run_on_ranks(_decode, 2, "silent", PG_TIMEOUT, timeout=120)
    assert res[1] == {"slept": True}
    out = res[0]
    assert out["step"] == FAIL_STEP, out
    # Bounded by init_parallel's timeout (3 s here), not gloo's 30-minute default.
    assert PG_TIMEOUT - 0.5 <= out["after_s"] <= PG_TIMEOUT + 3, out


def test_killed_rank_fails_its_peer_fast_and_is_named():
    with pytest.raises(RankFailed) as info:
        run_on_ranks(_decode, 2, "kill", FAST, timeout=120)
    exc = info.value
    assert exc.root == 1, str(exc)
    assert "died with exit code -9 (SIGKILL)" in exc.failures[1]
    assert 0 in exc.failures and exc.killed == [], str(exc)
    assert "peer rank 1 failed first: died with exit code -9 (SIGKILL)" in exc.failures[0], exc.failures[0]
    # times[1] is when the harness saw the death; the peer had already raised or did soon after.
    assert abs(exc.times[0] - exc.times[1]) < FAST / 3, str(exc)


def test_default_timeout_is_documented_and_configurable(monkeypatch):
    from cp_compile.runtime import parallel_state as ps

    monkeypatch.delenv(ps.PG_TIMEOUT_ENV, raising=False)
    assert ps.resolve_timeout(None) == ps.DEFAULT_PG_TIMEOUT_S == 600.0
    assert "600 s" in ps.__doc__ and "600 s" in ps.init_parallel.__doc__
    monkeypatch.setenv(ps.PG_TIMEOUT_ENV, "42")
    assert ps.resolve_timeout(None) == 42.0
    assert ps.resolve_timeout(7) == 7.0
    for bad in (0, -1, True, "5"):
        with pytest.raises(cp_compile.ConfigError, match="process-group timeout"):
            ps.resolve_timeout(bad)
    monkeypatch.setenv(ps.PG_TIMEOUT_ENV, "soon")
    with pytest.raises(cp_compile.ConfigError, match="CP_COMPILE_PG_TIMEOUT_S='soon'"):
        ps.resolve_timeout(None)
