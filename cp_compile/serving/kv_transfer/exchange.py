"""What the instances tell each other, through a torch.distributed TCPStore.

Keys (pickled values), under `cpkv/<producer engine_id>/`:
- `rank/<r>`: `RankInfo` of producer rank r (layout, geometry, cache regions, agent
  metadata), once at start;
- `req/<id>/ready/<r>`: `ReadyRequest` from producer rank r once its prefill of the
  request has written its cache (a consumer waits for every rank's);
- `req/<id>/consumed`: the consumer's verdict ("ok" or the error), set by consumer
  rank 0 after every consumer rank finished; the producer frees its blocks then;
- `req/<id>/claims`: a counter (`TCPStore.add`, atomic): each consumer rank adds 1
  before it reads, a producer giving up on the request adds `EXPIRED` (once: the
  fence). A request is read by one consumer instance, once: a rank that counts past
  its own world size (a replayed `kv_transfer_params`, or a request the producer
  expired) reads nothing. A rank that claimed before the fence finishes its reads
  within transfer_timeout_s of its claim (its read deadline starts before it), so
  the producer may free the blocks transfer_timeout_s after the fence whatever the
  consumer's verdict (kv_driver.ProducerSide: a verdict that cannot arrive).

The store is hosted by one instance (the producer's driver, `store_master`), so it can
go away with that instance. No store call may take the other instance down with it
(issue 35 item 5): every call runs with a deadline (`call_timeout_s`: a TCPStore client
whose server is stopped blocks forever in recv, whatever its own timeout says), and
its errors (DistNetworkError, DistStoreError, ConnectionError, TimeoutError, ...) are
raised as `KVTransferError` naming the store and the fix, which the consumer turns
into that one request's failure.
"""

from __future__ import annotations

import pickle
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist
from torch.distributed import TCPStore

T = TypeVar("T")

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
    def __init__(self, host: str, port: int, engine_id: str, master: bool = False, timeout_s: float = 60.0,
                 call_timeout_s: float = 60.0) -> None:
        """timeout_s: how long the first connection waits for the store to come up;
        call_timeout_s: the most any one later store call may take (a peer silent that
        long is stalled or lost)."""
        self.engine_id, self.host, self.port, self.master = engine_id, host, port, master
        self.call_timeout_s = call_timeout_s
        self.store: TCPStore | None = TCPStore(host, port, is_master=master, wait_for_workers=False,
                                               timeout=timedelta(seconds=timeout_s))

    def _client(self) -> TCPStore:
        """The store client; a new connection when the last one was abandoned (a call on it
        timed out: its thread may still be blocked in it, so it is never used again)."""
        if self.store is None:
            # A plain connect first: a store that is gone refuses at once (ConnectionRefusedError),
            # where TCPStore would retry until its timeout and name only the timeout.
            socket.create_connection((self.host, self.port), timeout=self.call_timeout_s).close()
            self.store = TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=self.call_timeout_s))
        return self.store

    def _call(self, what: str, op: Callable[[TCPStore], T], timeout_s: float | None = None) -> T:
        """`op(store)` with a deadline (`call_timeout_s`, or `timeout_s` plus it for a wait);
        a store that fails or does not answer raises `KVTransferError` naming it."""
        limit = self.call_timeout_s if timeout_s is None else timeout_s + self.call_timeout_s
        box: dict[str, Any] = {}
        done = threading.Event()

        def run() -> None:
            try:
                box["value"] = op(self._client())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = exc
            finally:
                done.set()

        # A daemon thread per call, not a pool: a call stuck on a stopped store must not
        # keep the process from exiting (a pool's threads are joined at exit).
        threading.Thread(target=run, name=f"cpkv-store-{what}", daemon=True).start()
        where = f"the KV-transfer store at {self.host}:{self.port} (producer {self.engine_id!r}'s)"
        fix = (f"Fix: check that producer {self.engine_id!r} is up (its driver hosts the store when store_master) "
               "and reachable at kv_ip / kv_port; once it is back, prefill the request there again")
        if not done.wait(limit):
            if not self.master:  # the blocked client is abandoned; the next call reconnects
                self.store = None
            raise KVTransferError(f"{what}: {where} did not answer within {limit:.0f} s (transfer_timeout_s="
                                  f"{self.call_timeout_s}: the producer is stalled or lost). {fix}")
        exc = box.get("error")
        if exc is None:
            return box["value"]
        if isinstance(exc, KVTransferError):
            raise exc
        if isinstance(exc, (dist.DistError, OSError, RuntimeError)):  # DistNetworkError, DistStoreError, ...
            if not self.master:
                self.store = None  # a broken connection: the next call reconnects
            first_line = (str(exc).splitlines() or [""])[0]  # torch appends a C++ stack to the message
            raise KVTransferError(f"{what}: {where} failed ({type(exc).__name__}: {first_line}). {fix}") from exc
        raise exc

    def _key(self, *parts: Any) -> str:
        return "/".join(["cpkv", self.engine_id, *map(str, parts)])

    def _set(self, key: str, value: Any, what: str) -> None:
        data = pickle.dumps(value)
        self._call(what, lambda st: st.set(key, data))

    def _check(self, key: str, what: str) -> bool:
        return bool(self._call(what, lambda st: st.check([key])))

    def _get(self, key: str, timeout_s: float, what: str) -> Any:
        def wait_get(st: TCPStore) -> bytes | None:
            try:
                st.wait([key], timedelta(seconds=timeout_s))
            except Exception as exc:  # noqa: BLE001 - torch raises DistStoreError / RuntimeError on timeout
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    return None  # the key never came: named below, not as a broken store
                raise
            return st.get(key)

        data = self._call(what, wait_get, timeout_s)
        if data is None:
            raise KVTransferError(f"{what}: nothing at store key {key!r} after {timeout_s:.0f} s. Fix: check that the "
                                  f"other instance is up and uses the same kv_ip / kv_port and producer engine_id "
                                  f"{self.engine_id!r}")
        return pickle.loads(data)

    def publish_rank(self, info: RankInfo, world_size: int) -> None:
        self._set(self._key("rank", info.rank), info, f"publishing producer rank {info.rank}")
        if info.rank == 0:
            self._set(self._key("world_size"), world_size, "publishing the producer's world size")

    def fetch_ranks(self, timeout_s: float) -> dict[int, RankInfo]:
        world = self._get(self._key("world_size"), timeout_s, f"producer {self.engine_id!r} world size")
        return {r: self._get(self._key("rank", r), timeout_s, f"producer rank {r}") for r in range(world)}

    def publish_ready(self, rank: int, ready: ReadyRequest) -> None:
        self._set(self._key("req", ready.req_id, "ready", rank), ready, f"request {ready.req_id}: publishing it ready")

    def fetch_ready(self, req_id: int, world_size: int, timeout_s: float, rest_timeout_s: float) -> ReadyRequest:
        """Every producer rank's `ReadyRequest` for `req_id`: the first may take `timeout_s`
        (the prefill runs), the others must follow within `rest_timeout_s` of it (the
        ranks finish one prefill together: a rank still silent then is stalled or lost)."""
        keys = [self._key("req", req_id, "ready", r) for r in range(world_size)]
        start = time.monotonic()
        first_at: float | None = None
        while True:
            have = [r for r, k in enumerate(keys) if self._check(k, f"request {req_id}: waiting for producer rank {r}")]
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
        got = [pickle.loads(self._call(f"request {req_id}: reading producer rank {r}'s ready report",
                                       lambda st, k=k: st.get(k))) for r, k in enumerate(keys)]
        if any(g != got[0] for g in got[1:]):
            raise KVTransferError(f"producer ranks disagree on request {req_id}: {got}")
        return got[0]

    def claim(self, req_id: int) -> int:
        """A consumer rank's claim on `req_id` before it reads: the count so far, this one
        included (1..world for the first import; more for a replay or an expired request)."""
        key = self._key("req", req_id, "claims")
        return int(self._call(f"request {req_id}: claiming it", lambda st: st.add(key, 1)))

    def claims(self, req_id: int) -> int:
        """How many consumer-rank claims `req_id` has so far (the producer's look; no claim)."""
        key = self._key("req", req_id, "claims")
        return int(self._call(f"request {req_id}: reading its claims", lambda st: st.add(key, 0)))

    def expire(self, req_id: int) -> int:
        """The producer gives up on `req_id` (call once per request: the fence). Any claim
        after it counts past EXPIRED and reads nothing. Returns the claims made before it:
        0 = nobody read, the blocks may be freed now; more = those ranks may still be
        reading, for at most transfer_timeout_s (see the module doc)."""
        key = self._key("req", req_id, "claims")
        return int(self._call(f"request {req_id}: expiring it", lambda st: st.add(key, EXPIRED))) - EXPIRED

    def publish_consumed(self, req_id: int, verdict: str) -> None:
        self._set(self._key("req", req_id, "consumed"), verdict, f"request {req_id}: telling the producer the verdict")

    def poll_consumed(self, req_id: int) -> str | None:
        """The consumer's verdict on `req_id` if it is there, else None (no wait)."""
        key = self._key("req", req_id, "consumed")
        what = f"request {req_id}: reading the consumer's verdict"
        return pickle.loads(self._call(what, lambda st: st.get(key))) if self._check(key, what) else None

    def wait_consumed(self, req_id: int, timeout_s: float) -> str:
        return self._get(self._key("req", req_id, "consumed"), timeout_s, f"consumer verdict on request {req_id}")
