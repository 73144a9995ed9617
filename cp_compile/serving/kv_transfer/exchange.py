"""What the instances tell each other, through a torch.distributed TCPStore.

Keys (pickled values), under `cpkv/<producer engine_id>/`:
- `rank/<r>`: `RankInfo` of producer rank r (layout, geometry, cache regions, agent
  metadata), once at start;
- `req/<id>/ready/<r>`: `ReadyRequest` from producer rank r once its prefill of the
  request has written its cache (a consumer waits for every rank's);
- `req/<id>/consumed`: the consumer's verdict ("ok" or the error), set by consumer
  rank 0 after every consumer rank finished; the producer frees its blocks then;
- `req/<id>/claims`: a counter (`TCPStore.add`, atomic): each consumer rank adds 1
  before it reads, a producer giving up on the request adds `EXPIRED`. A request is
  read by one consumer instance, once: a rank that counts past its own world size
  (a replayed `kv_transfer_params`, or a request the producer expired) reads nothing.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

EXPIRED = 1 << 30  # the producer's claim on a request it gave up on (exchange.expire)

from cp_compile.serving.kv_transfer.layout import KVGeometry, KVLayout
from cp_compile.serving.kv_transfer.regions import CacheRegion
from cp_compile.serving.kv_transfer.transport import KVTransferError

_POLL_S = 0.005


@dataclass(frozen=True)
class RankInfo:
    engine_id: str
    rank: int
    layout: KVLayout
    geometry: KVGeometry
    regions: tuple[CacheRegion, ...]
    agent_metadata: bytes


@dataclass(frozen=True)
class ReadyRequest:
    req_id: int
    num_tokens: int  # tokens in the producer's cache (the prompt)
    block_table: tuple[int, ...]  # producer virtual block ids
    first_token: int  # the token the prefill sampled


class Exchange:
    def __init__(self, host: str, port: int, engine_id: str, master: bool = False, timeout_s: float = 60.0) -> None:
        self.engine_id = engine_id
        self.store = TCPStore(host, port, is_master=master, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))

    def _key(self, *parts: Any) -> str:
        return "/".join(["cpkv", self.engine_id, *map(str, parts)])

    def _set(self, key: str, value: Any) -> None:
        self.store.set(key, pickle.dumps(value))

    def _get(self, key: str, timeout_s: float, what: str) -> Any:
        try:
            self.store.wait([key], timedelta(seconds=timeout_s))
        except Exception as exc:  # torch raises DistStoreError / RuntimeError on timeout
            raise KVTransferError(f"{what}: nothing at store key {key!r} after {timeout_s:.0f} s "
                                  f"({type(exc).__name__}). Fix: check that the other instance is up and uses the same "
                                  f"kv_ip / kv_port and producer engine_id {self.engine_id!r}") from exc
        return pickle.loads(self.store.get(key))

    def publish_rank(self, info: RankInfo, world_size: int) -> None:
        self._set(self._key("rank", info.rank), info)
        if info.rank == 0:
            self._set(self._key("world_size"), world_size)

    def fetch_ranks(self, timeout_s: float) -> dict[int, RankInfo]:
        world = self._get(self._key("world_size"), timeout_s, f"producer {self.engine_id!r} world size")
        return {r: self._get(self._key("rank", r), timeout_s, f"producer rank {r}") for r in range(world)}

    def publish_ready(self, rank: int, ready: ReadyRequest) -> None:
        self._set(self._key("req", ready.req_id, "ready", rank), ready)

    def fetch_ready(self, req_id: int, world_size: int, timeout_s: float, rest_timeout_s: float) -> ReadyRequest:
        """Every producer rank's `ReadyRequest` for `req_id`: the first may take `timeout_s`
        (the prefill runs), the others must follow within `rest_timeout_s` of it (the
        ranks finish one prefill together: a rank still silent then is stalled or lost)."""
        keys = [self._key("req", req_id, "ready", r) for r in range(world_size)]
        start = time.monotonic()
        first_at: float | None = None
        while True:
            have = [r for r, k in enumerate(keys) if self.store.check([k])]
            now = time.monotonic()
            if len(have) == world_size:
                break
            if have and first_at is None:
                first_at = now
            if first_at is None and now - start > timeout_s:
                raise KVTransferError(f"request {req_id}: no producer rank reported it ready within "
                                      f"handoff_timeout_s={timeout_s} (store key {keys[0]!r} ...). Fix: check that "
                                      f"producer {self.engine_id!r} is up, prefills the request and uses the same "
                                      f"kv_ip / kv_port")
            if first_at is not None and now - first_at > rest_timeout_s:
                missing = [r for r in range(world_size) if r not in have]
                raise KVTransferError(f"request {req_id}: producer rank(s) {missing} did not report it ready within "
                                      f"transfer_timeout_s={rest_timeout_s} of producer rank(s) {have} (stalled or "
                                      f"lost). Fix: restart producer {self.engine_id!r}'s rank(s) {missing}")
            time.sleep(_POLL_S)
        got = [pickle.loads(self.store.get(k)) for k in keys]
        if any(g != got[0] for g in got[1:]):
            raise KVTransferError(f"producer ranks disagree on request {req_id}: {got}")
        return got[0]

    def claim(self, req_id: int) -> int:
        """A consumer rank's claim on `req_id` before it reads: the count so far, this one
        included (1..world for the first import; more for a replay or an expired request)."""
        return self.store.add(self._key("req", req_id, "claims"), 1)

    def expire(self, req_id: int) -> bool:
        """The producer gives up on `req_id` (no verdict in time): True if no consumer rank
        had claimed it (its blocks may be freed: any later claim counts past EXPIRED);
        False if one is reading it (wait for its verdict instead)."""
        return self.store.add(self._key("req", req_id, "claims"), EXPIRED) == EXPIRED

    def publish_consumed(self, req_id: int, verdict: str) -> None:
        self._set(self._key("req", req_id, "consumed"), verdict)

    def poll_consumed(self, req_id: int) -> str | None:
        """The consumer's verdict on `req_id` if it is there, else None (no wait)."""
        key = self._key("req", req_id, "consumed")
        return pickle.loads(self.store.get(key)) if self.store.check([key]) else None

    def wait_consumed(self, req_id: int, timeout_s: float) -> str:
        return self._get(self._key("req", req_id, "consumed"), timeout_s, f"consumer verdict on request {req_id}")
