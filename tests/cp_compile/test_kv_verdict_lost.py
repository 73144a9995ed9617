"""Issue 35: a consumer's verdict that never reaches the producer does not hold the
producer's blocks forever.

The producer's driver side (`ProducerSide`, hosting the real TCPStore) holds three
exported requests; the consumer is played by store clients doing what `KVConsumer`
does (its ranks' claims, rank 0's verdict), no NIXL needed:
- request 0: two consumer ranks claim it, read, and the verdict never comes (rank 0
  could not reach the store, or the consumer died after its reads);
- request 1: claimed and told "ok" (the usual path);
- request 2: nobody ever claims it.
Before the fix, request 0 was held for good: the handoff expiry freed only unclaimed
requests (and re-added its EXPIRED claim on every poll). Now it is freed within
transfer_timeout_s + VERDICT_GRACE_S of the last claim (twice that at most, counted
from the export), and a late claim is refused (it would read freed blocks); so is a
replayed claim of a request whose verdict did come (the producer fences every request
before freeing it).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from cp_compile.serving.entrypoints import kv_driver
from cp_compile.serving.entrypoints.kv_driver import ProducerSide
from cp_compile.serving.loop.scheduler import Scheduler, Sequence
from cp_compile.serving.kv_transfer import KVTransferConfig
from cp_compile.serving.kv_transfer.exchange import Exchange
from tests.entrypoints.http_util import free_port

TRANSFER_S, HANDOFF_S, GRACE_S = 0.5, 2.0, 0.5


class NoRanks:
    """Stand-in for the producer's ranks: the export command is only recorded (the
    ranks' part, publishing each request ready, is not what this test is about)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def call(self, kind: str, payload: Any) -> list[None]:
        self.calls.append((kind, payload))
        return [None]


def test_a_claimed_request_whose_verdict_never_comes_is_freed_within_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(kv_driver, "VERDICT_GRACE_S", GRACE_S, raising=False)
    port = free_port()
    kv = KVTransferConfig("kv_producer", engine_id="p-lost", kv_port=port, kv_connector_extra_config={
        "store_master": True, "transfer_timeout_s": TRANSFER_S, "handoff_timeout_s": HANDOFF_S})
    side = ProducerSide(kv)
    sched = Scheduler(num_blocks=8, virtual_block_size=4, max_batch=4)
    seqs = [sched.add(s) or s for s in (Sequence(i, [1, 2, 3, 4, 5], 1, payload=SimpleNamespace()) for i in range(3))]
    sched.plan()
    done = sched.commit([7, 7, 7])  # each prefill's one token: all three leave, exported and held
    t0 = time.monotonic()  # times are from the export (each request's hold starts there)
    side.after_commit(NoRanks(), sched, done)
    assert sorted(side.held) == [0, 1, 2] and sched.reserved == 3 * 2

    consumer = Exchange("127.0.0.1", port, "p-lost", call_timeout_s=5.0)  # what KVConsumer's ranks use
    assert [consumer.claim(0), consumer.claim(0)] == [1, 2]  # two consumer ranks read request 0 ...
    consumer.claim(1), consumer.claim(1)
    consumer.publish_consumed(1, "ok")  # ... request 1's verdict arrives; request 0's never does

    freed_at: dict[int, float] = {}
    while side.held and time.monotonic() - t0 < 40.0:
        side.release_consumed(sched)
        freed_at.update({rid: time.monotonic() - t0 for rid in side.verdicts if rid not in freed_at})
        time.sleep(0.05)
    print(f"\nfreed after (s): {freed_at}; verdicts: {side.verdicts}")
    assert not side.held, f"still held after 40 s: {sorted(side.held)} (verdicts so far {side.verdicts})"
    assert side.verdicts[1] == "ok"
    assert side.verdicts[0].startswith("lost: consumer ranks claimed it (2 claims)"), side.verdicts[0]
    # the bound (twice: the verdict is looked for late, then the claims wait), plus store calls on a
    # loaded box (a few per poll, each on a thread of its own)
    assert freed_at[0] < 2 * (TRANSFER_S + GRACE_S) + 10.0
    assert side.verdicts[2].startswith("timeout: no consumer verdict within handoff_timeout_s=2.0")
    assert HANDOFF_S <= freed_at[2] < HANDOFF_S + 10.0
    assert sched.reserved == 0 and sorted(sched.drain_free()) == [0, 1, 2]  # every block back
    # A consumer rank that claims now counts past the fence and reads nothing: request 0's late
    # rank, a never-claimed one, and a replay of request 1's kv_transfer_params after its verdict.
    assert consumer.claim(0) > 2 and consumer.claim(2) > 1 and consumer.claim(1) > 2
