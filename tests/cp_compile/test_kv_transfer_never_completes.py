"""A prefill whose KV reads never complete: the decode request fails within a bound.

One process, two NIXL agents (UCX over DRAM): a producer at (tp 1, block 4) with a
prefilled-looking cache, a consumer at (tp 1, block 8). The consumer's transport is the
real `NixlTransport` behind a fault-injecting wrapper: its reads from the producer are
accepted but never complete (a peer that stopped serving them; `state` stays PROC).
`import_request` must give up after transfer_timeout_s with the layer and producer rank
named, free the request's decode blocks, leave the cache untouched (nothing of the
request is attended) and tell the producer. If the stuck read cannot even be released,
the blocks stay reserved (quarantined) instead of being handed to another request.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

import cp_compile
from cp_compile.serving.kv_transfer import KVConsumer, KVProducer, KVTransferError
from cp_compile.serving.kv_transfer.nixl import NixlTransport
from tests.entrypoints.http_util import free_port

pytest.importorskip("nixl_cu12")

SPEC = cp_compile.KVCacheSpec(2, "gqa", head_dim=8, v_head_dim=8, num_kv_heads_per_rank=1)
ATTN = cp_compile.AttentionSpec("gqa", 2, 1)
TIMEOUT_S = 1.5


class NeverCompletes:
    """Fault injection: reads are accepted, never posted, never complete."""

    def __init__(self, inner: NixlTransport, release_fails: bool = False) -> None:
        self.inner, self.name, self.release_fails = inner, inner.name, release_fails
        self.posted = 0

    def register(self, tensors):
        return self.inner.register(tensors)

    def deregister(self, handle):
        self.inner.deregister(handle)

    def metadata(self) -> bytes:
        return self.inner.metadata()

    def connect(self, metadata: bytes) -> str:
        return self.inner.connect(metadata)

    def read(self, peer: str, local, remote) -> Any:
        self.posted += len(local)
        return object()

    def state(self, handle) -> str:
        return "PROC"

    def release(self, handle) -> None:
        if self.release_fails:
            raise KVTransferError("injected: the transfer cannot be aborted")


def _pair(tag: str, release_fails: bool):
    port = free_port()
    p_cfg = cp_compile.CPConfig(block_size=4)
    d_cfg = cp_compile.CPConfig(block_size=8)
    p_cache = cp_compile.allocate_kv_cache(p_cfg, SPEC, 8, attention=ATTN)
    for layer in p_cache.layers:
        for t in layer:
            t.normal_()
    d_cache = cp_compile.allocate_kv_cache(d_cfg, SPEC, 8, attention=ATTN)
    extra = {"transfer_timeout_s": TIMEOUT_S, "handoff_timeout_s": 30}
    producer = KVProducer({"kv_role": "kv_producer", "engine_id": f"p-{tag}", "kv_port": port,
                           "kv_connector_extra_config": {**extra, "store_master": True}}, p_cfg, p_cache, SPEC, ATTN, 0)
    p_alloc = cp_compile.BlockAllocator(8, p_cfg.virtual_block_size)
    producer.export(0, 10, p_alloc.ensure(0, 10), first_token=3)
    d_alloc = cp_compile.BlockAllocator(8, d_cfg.virtual_block_size)
    transport = NeverCompletes(NixlTransport(f"d-{tag}/d0"), release_fails)
    consumer = KVConsumer({"kv_role": "kv_consumer", "engine_id": f"d-{tag}", "kv_port": port,
                           "kv_connector_extra_config": {**extra, "remote_engine_id": f"p-{tag}"}},
                          d_cfg, d_cache, SPEC, ATTN, 0, d_alloc, transport=transport)
    return producer, consumer, d_cache, d_alloc, transport


def test_reads_that_never_complete_fail_the_request_within_the_bound():
    producer, consumer, cache, alloc, transport = _pair("a", release_fails=False)
    t0 = time.monotonic()
    with pytest.raises(KVTransferError) as e:
        consumer.import_request(0, local_id=5)
    took = time.monotonic() - t0
    msg = str(e.value)
    print(f"\nnever completes: failed after {took:.2f} s: {msg}")
    assert transport.posted > 0  # the reads were posted (layer 0), then waited on
    assert "reads of layer 0 from producer ranks [0] not done within transfer_timeout_s=1.5" in msg
    assert "its decode blocks were freed" in msg
    assert TIMEOUT_S <= took < TIMEOUT_S + 10
    assert alloc.num_free == alloc.num_blocks and not consumer.quarantined
    assert all(int(t.count_nonzero()) == 0 for layer in cache.layers for t in layer)  # nothing landed
    assert producer.wait_consumed(0, 5).startswith("failed: request 0: KV transfer from 'p-a' failed")


def test_a_read_that_cannot_be_released_quarantines_the_blocks():
    producer, consumer, cache, alloc, transport = _pair("b", release_fails=True)
    with pytest.raises(KVTransferError, match="decode blocks stay reserved"):
        consumer.import_request(0, local_id=5)
    assert consumer.quarantined == [5] and alloc.blocks(5)  # never handed to another request
    assert alloc.num_free == alloc.num_blocks - len(alloc.blocks(5))
