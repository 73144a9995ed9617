"""The two roles: `KVProducer` (prefill instance) and `KVConsumer` (decode instance).

Every rank of each instance builds its role object over its own cache. A producer
rank registers its cache with the transport and publishes a `RankInfo`; after a
prefill it `export`s the request (its block table and sampled token) and keeps the
blocks until the consumer's verdict (`wait_consumed`). A consumer rank
`import_request`s: it checks the producer's model geometry against its own
(`ConfigError` before anything moves), allocates the request's blocks in its own
`BlockAllocator`, plans its reads (`plan.plan_rank`: exactly the tokens and heads it
owns, from the producer ranks that hold them), reads layer by layer with the
ownership of the destination blocks re-checked before each layer, and agrees with
the other consumer ranks (one all-reduce over `group`) before the request may be
scheduled. On any failure (peer lost, timeout, refused descriptors) every consumer
rank frees the request's blocks and raises `KVTransferError`: nothing of a partial
transfer is ever attended.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from cp_compile.base.config import AttentionSpec, CPConfig
from cp_compile.base.errors import CapacityError, ConfigError
from cp_compile.runtime.kv_cache import KVCache, KVCacheSpec
from cp_compile.serving.kv_transfer.config import KVTransferConfig
from cp_compile.serving.kv_transfer.exchange import EXPIRED, Exchange, RankInfo, ReadyRequest
from cp_compile.serving.kv_transfer.layout import KVGeometry, KVLayout, check_compatible
from cp_compile.serving.kv_transfer.nixl import NixlTransport
from cp_compile.serving.kv_transfer.plan import RankPlan, plan_rank
from cp_compile.serving.kv_transfer.reads import group_runs, layer_reads, same_rows
from cp_compile.serving.kv_transfer.regions import CacheRegion, check_in_regions, regions_of
from cp_compile.serving.kv_transfer.transport import KVAlreadyImportedError, KVOwnershipError, KVTransferError, KVTransport
from cp_compile.runtime.metadata_build import BlockAllocator

_POLL_S = 0.0005
# What a consumer rank got fetching the producer's description (agreed: the lowest wins).
_REFUSED, _FAILED, _FETCHED = 0, 1, 2


def _tensors(cache: KVCache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in layer] + list(cache.replicated)


def _device_id(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else 0


def _make_transport(name: str, cache: KVCache) -> KVTransport:
    device = _tensors(cache)[0].device
    return NixlTransport(name, mem_type="DRAM" if device.type == "cpu" else "VRAM")


class _Role:
    def __init__(self, kv_transfer_config: Any, cfg: CPConfig, cache: KVCache, spec: KVCacheSpec,
                 attention: AttentionSpec, rank: int, transport: KVTransport | None, role: str) -> None:
        self.kv = KVTransferConfig.from_dict(kv_transfer_config)
        if self.kv.kv_role != role:
            raise ConfigError(f"a {type(self).__name__} has kv_role {role}", f"kv_role={self.kv.kv_role!r}",
                              f"build the {'KVProducer' if self.kv.is_producer else 'KVConsumer'} for this config")
        self.cfg, self.cache, self.rank = cfg, cache, rank
        self.layout = KVLayout.from_config(cfg)
        self.geometry = KVGeometry.of(spec, attention, _tensors(cache)[0].dtype, cache.kv_cache_dtype,
                                      index_dtype=cache.replicated[0].dtype if cache.replicated else None)
        self.regions = regions_of(cache.layers, cache.replicated, spec.kind, quantized=cache.quantized)
        side = "p" if self.kv.is_producer else "d"
        self.transport = transport or _make_transport(f"{self.kv.engine_id}/{side}{rank}", cache)
        self.transport.register(_tensors(cache))


class KVProducer(_Role):
    """Prefill-instance side: publishes this rank's cache, exports finished prefills."""

    def __init__(self, kv_transfer_config: Any, cfg: CPConfig, cache: KVCache, spec: KVCacheSpec,
                 attention: AttentionSpec, rank: int, transport: KVTransport | None = None) -> None:
        super().__init__(kv_transfer_config, cfg, cache, spec, attention, rank, transport, "kv_producer")
        self.exchange = Exchange(self.kv.kv_ip, self.kv.kv_port, self.kv.engine_id,
                                 master=self.kv.store_master and rank == 0, timeout_s=self.kv.handoff_timeout_s,
                                 call_timeout_s=self.kv.transfer_timeout_s)
        self.exchange.publish_rank(RankInfo(self.kv.engine_id, rank, self.layout, self.geometry, self.regions,
                                            self.transport.metadata()), self.layout.world_size)

    def export(self, req_id: int, num_tokens: int, block_table: list[int], first_token: int) -> None:
        """Call on every producer rank once the prefill of `req_id` wrote its cache."""
        self.exchange.publish_ready(self.rank, ReadyRequest(req_id, num_tokens, tuple(block_table), first_token))

    def wait_consumed(self, req_id: int, timeout_s: float | None = None) -> str:
        """Block until the consumer is done with `req_id` ("ok" or its error); then free its blocks."""
        return self.exchange.wait_consumed(req_id, self.kv.handoff_timeout_s if timeout_s is None else timeout_s)


@dataclass
class ImportedRequest:
    req_id: int
    num_tokens: int  # tokens now in this instance's cache
    first_token: int  # sampled by the prefill: the first token to decode from
    bytes_moved: int  # into this rank
    seconds: float  # this rank's reads, first post to last completion
    src_ranks: tuple[int, ...]  # producer ranks this rank read from
    descriptors: int = 0  # NIXL descriptors this rank posted (all layers)


class KVConsumer(_Role):
    """Decode-instance side: imports requests into blocks of `allocator`."""

    def __init__(self, kv_transfer_config: Any, cfg: CPConfig, cache: KVCache, spec: KVCacheSpec,
                 attention: AttentionSpec, rank: int, allocator: BlockAllocator,
                 group: dist.ProcessGroup | None = None, transport: KVTransport | None = None,
                 coalesce: bool = True) -> None:
        """coalesce=False: one descriptor per plan run (the uncoalesced reads, for comparison)."""
        super().__init__(kv_transfer_config, cfg, cache, spec, attention, rank, transport, "kv_consumer")
        if allocator.block_tokens != self.layout.virtual_block_size:
            raise ConfigError("the consumer's allocator hands out virtual blocks of block_size * pcp * dcp",
                              f"allocator blocks of {allocator.block_tokens}, layout {self.layout.describe()}",
                              f"use BlockAllocator(num_blocks, {self.layout.virtual_block_size})")
        self.allocator, self.group = allocator, group
        self.exchange = Exchange(self.kv.kv_ip, self.kv.kv_port, self.kv.remote_engine_id,
                                 timeout_s=self.kv.handoff_timeout_s, call_timeout_s=self.kv.transfer_timeout_s)
        self._producer: dict[int, RankInfo] | None = None
        self._peers: dict[int, str] = {}
        self.quarantined: list[int] = []  # requests whose blocks an unreleasable transfer may still write
        self.coalesce = coalesce
        self._staging: torch.Tensor | None = None  # uint8, registered: staged reads land here (reads.py)
        self._staging_reg: Any = None
        self._retired: list[torch.Tensor] = []  # staging buffers an unreleasable read may still write

    # -- producer description, fetched and checked once, agreed by every consumer rank
    def producer(self) -> dict[int, RankInfo]:
        """The producer's rank descriptions, checked against this consumer's geometry.

        Collective over `group` until it succeeds (every consumer rank calls it at the same
        point: `import_request` does): each rank fetches, then the ranks agree on one
        outcome before any acts on it (issue 35): refused (a `ConfigError` on any rank),
        failed (a `KVTransferError` on any rank: the store did not answer one of them), or
        fetched on all. Only then is it cached, on every rank alike, so the next call is a
        collective on all ranks or on none. Before, a rank whose fetch failed raised
        alone while the others went on to claim and read the request and waited in the
        verdict's all-reduce for it: split verdicts, and a hang."""
        if self._producer is None:
            infos: dict[int, RankInfo] | None = None
            error: Exception | None = None
            try:
                infos = self._fetch_producer()
            except (ConfigError, KVTransferError) as exc:
                error = exc
            agreed = self._agree(_FETCHED if error is None else
                                 _FAILED if isinstance(error, KVTransferError) else _REFUSED)
            if agreed == _REFUSED:
                if isinstance(error, ConfigError):
                    raise error
                raise ConfigError("the producer's description suits every consumer rank",
                                  f"producer {self.kv.remote_engine_id!r} refused by another consumer rank"
                                  + (f" (this rank: {error})" if error is not None else ""),
                                  "see the refusing rank's error: the instances serve different models or layouts")
            if agreed == _FAILED:
                why = str(error) if error is not None else "another consumer rank could not fetch it"
                raise KVTransferError(f"producer {self.kv.remote_engine_id!r}'s description: {why}")
            assert infos is not None
            self._producer = infos
        return self._producer

    def _fetch_producer(self) -> dict[int, RankInfo]:
        infos = self.exchange.fetch_ranks(self.kv.handoff_timeout_s)
        layouts = {i.layout for i in infos.values()}
        if len(layouts) != 1 or len(infos) != next(iter(layouts)).world_size:
            raise ConfigError("producer ranks publish one layout over its whole world",
                              f"layouts {sorted(map(str, layouts))} from {len(infos)} ranks",
                              "restart the producer instance: its ranks disagree")
        check_compatible(infos[0].geometry, self.geometry)
        return infos

    def _agree(self, code: int) -> int:
        """The lowest of every consumer rank's `code` (one all-reduce over `group`; this
        rank's own code without torch.distributed)."""
        t = torch.tensor([code], dtype=torch.int32, device=_tensors(self.cache)[0].device)
        if dist.is_initialized():
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)

    def _peer(self, src: int) -> str:
        if src not in self._peers:
            self._peers[src] = self.transport.connect(self.producer()[src].agent_metadata)
        return self._peers[src]

    def check_owned(self, req_id: int, plan: RankPlan) -> None:
        """The plan writes only blocks `req_id` owns now (KVOwnershipError otherwise)."""
        owned = self.allocator.blocks(req_id)
        if list(plan.dst_blocks) != owned[: len(plan.dst_blocks)]:
            raise KVOwnershipError(
                f"request {req_id}: the transfer would write blocks {list(plan.dst_blocks)} but the request owns "
                f"{owned} (freed or reassigned). Fix: plan the transfer from the request's current block table; "
                f"an aborted request's transfer must not continue")

    def _staging_for(self, nbytes: int) -> torch.Tensor:
        """A registered staging buffer of at least `nbytes` (grown geometrically, the old one deregistered)."""
        if self._staging is None or self._staging.numel() < nbytes:
            if self._staging is not None:
                self.transport.deregister(self._staging_reg)
            size = max(nbytes, 2 * (self._staging.numel() if self._staging is not None else 0))
            self._staging = torch.empty(size, dtype=torch.uint8, device=_tensors(self.cache)[0].device)
            self._staging_reg = self.transport.register([self._staging])
        return self._staging

    def read_plan(self, req_id: int, plan: RankPlan, deadline: float,
                  on_layer: Callable[[int], None] | None = None) -> tuple[int, int]:
        """Post the plan's reads layer by layer, each layer's to all its source ranks at
        once (coalesced, `reads.layer_reads`); ownership re-checked before each layer and
        before the staged rows are copied into the cache. Returns (bytes read, descriptors)."""
        remote = {s: self.producer()[s].regions for s in plan.src_ranks()}
        moved = ndesc = 0
        # the runs' grouping is the same for every layer of equal row sizes: built once per request
        groups = group_runs(plan, self.regions, remote, 0) if self.coalesce and same_rows(self.regions, remote) \
            else None
        for layer in range(self.geometry.num_layers):
            self.check_owned(req_id, plan)
            reads = layer_reads(plan, self.regions, remote, layer, coalesce=self.coalesce, groups=groups)
            local_regions = self.regions
            staging = None
            if reads.staging_bytes:
                staging = self._staging_for(reads.staging_bytes)
                local_regions = self.regions + (CacheRegion("staging", -1, staging.data_ptr(), staging.numel(), 1, 1,
                                                            _device_id(staging)),)
            per_src = reads.bind(staging.data_ptr() if staging is not None else 0,
                                 _device_id(staging) if staging is not None else 0)
            ndesc += reads.num_descriptors
            handles = []
            try:
                for s, (loc, rem) in per_src.items():
                    check_in_regions(loc, local_regions, "decode")
                    try:
                        handles.append((s, self.transport.read(self._peer(s), loc, rem)))
                    except KVTransferError as exc:
                        raise KVTransferError(f"posting the read of layer {layer} from producer rank {s} "
                                              f"failed ({exc})") from exc
                    moved += int(loc[:, 1].sum())
                pending = list(handles)
                while pending:
                    still = []
                    for s, h in pending:
                        try:
                            st = self.transport.state(h)
                        except KVTransferError as exc:
                            raise KVTransferError(f"the read of layer {layer} from producer rank {s} "
                                                  f"failed ({exc})") from exc
                        if st == "ERR":
                            raise KVTransferError(f"the read of layer {layer} from producer rank {s} failed "
                                                  f"(transfer state ERR)")
                        if st == "PROC":
                            still.append((s, h))
                    pending = still
                    if pending and time.monotonic() > deadline:
                        raise KVTransferError(f"reads of layer {layer} from producer ranks "
                                              f"{[s for s, _ in pending]} not done within transfer_timeout_s="
                                              f"{self.kv.transfer_timeout_s}")
                    if pending:
                        time.sleep(_POLL_S)
            finally:
                for _, h in handles:
                    try:
                        self.transport.release(h)
                    except KVTransferError:  # may still write: the blocks must not be handed out again
                        self.quarantined.append(req_id)
                        if staging is not None:  # nor the staging buffer: kept alive, never reused
                            self._retired.append(staging)
                            self._staging = None
            if staging is not None:
                self.check_owned(req_id, plan)  # the blocks may have been dropped while the reads ran
                reads.scatter(_tensors(self.cache), staging)
            if on_layer is not None:
                on_layer(layer)
        return moved, ndesc

    def _tell_producer(self, req_id: int, verdict: str) -> str:
        """Publish the verdict (rank 0 only); returns "" or why the producer could not be told.
        Best effort: the request's own outcome is decided here, and a producer whose store is
        gone or silent cannot free its blocks anyway (it expires them after handoff_timeout_s
        if it comes back). Raising here would turn a failed request into a failed rank."""
        if self.rank != 0:
            return ""
        try:
            self.exchange.publish_consumed(req_id, verdict)
        except KVTransferError as exc:
            return f" (the producer could not be told: {exc})"
        return ""

    def import_request(self, req_id: int, on_layer: Callable[[int], None] | None = None,
                       local_id: int | None = None) -> ImportedRequest:
        """Bring request `req_id` of the producer into this instance, under `local_id` in
        this instance's allocator (default `req_id`: a front end numbers its own
        requests). Collective over the consumer's `group` (every consumer rank calls it,
        in the same order)."""
        mine = req_id if local_id is None else local_id
        try:
            infos = self.producer()  # agreed by every rank; geometry checked: refuses before any byte moves
        except ConfigError as exc:
            self._tell_producer(req_id, f"refused: {exc}")
            raise
        except KVTransferError as exc:  # every rank alike; nothing claimed, allocated or read
            msg = f"request {req_id}: KV transfer from {self.kv.remote_engine_id!r} failed on consumer rank " \
                  f"{self.rank}: {exc}. The request is not scheduled; no decode block was allocated"
            raise KVTransferError(msg + self._tell_producer(req_id, f"failed: {msg}")) from exc
        src_layout = infos[0].layout
        error: BaseException | None = None
        moved, ndesc, t0, plan = 0, 0, time.perf_counter(), None
        try:  # every failure from here reaches the agreement below (the ranks' verdicts may differ)
            ready = self.exchange.fetch_ready(req_id, len(infos), self.kv.handoff_timeout_s,
                                              self.kv.transfer_timeout_s)
            deadline = time.monotonic() + self.kv.transfer_timeout_s  # the reads' bound starts once P is ready
            t0 = time.perf_counter()
            world = dist.get_world_size(self.group) if dist.is_initialized() else 1
            claims = self.exchange.claim(req_id)
            if claims > world:  # before anything is allocated or read
                raise KVAlreadyImportedError(
                    f"request {req_id} of producer {self.kv.remote_engine_id!r} was already imported by a consumer "
                    f"or expired on the producer ({'expired by the producer' if claims >= EXPIRED else f'{claims} claims'}"
                    f" for {world} consumer ranks): its producer blocks "
                    "may hold another request's KV now. Fix: prefill the prompt on the producer again and send its "
                    "new kv_transfer_params (each is good for one import)")
            self.allocator.ensure(mine, ready.num_tokens)  # CapacityError: nothing allocated, nothing moved
            plan = plan_rank(src_layout, self.layout, self.geometry, ready.num_tokens, ready.block_table,
                             self.allocator.blocks(mine), self.rank)
            moved, ndesc = self.read_plan(mine, plan, deadline, on_layer)
        except Exception as exc:  # noqa: BLE001 - every failure must reach the agreement below
            error = exc
        seconds = time.perf_counter() - t0
        # the consumer ranks agree, on the group's device (gloo: CPU, NCCL / HCCL: the caches')
        ok = torch.tensor([0 if error is not None else 1], dtype=torch.int32, device=_tensors(self.cache)[0].device)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self.group)
        if int(ok) == 0:
            why = str(error) if error is not None else "another consumer rank's reads failed"
            if isinstance(error, CapacityError):  # nothing was allocated: refused, as before any byte moves
                self._tell_producer(req_id, f"refused: {error}")
                raise error
            if mine in self.quarantined:  # a read NIXL could not release may still land: keep the blocks
                fate = "its decode blocks stay reserved (cp_compile KVConsumer.quarantined): a read could not be released"
            else:
                self.allocator.free(mine)  # a no-op when the request was already dropped or never allocated
                fate = "its decode blocks were freed"
            msg = f"request {req_id}: KV transfer from {self.kv.remote_engine_id!r} failed on consumer rank " \
                  f"{self.rank}: {why}. The request is not scheduled; {fate}"
            if not isinstance(error, KVAlreadyImportedError):  # the first import's verdict stays
                msg += self._tell_producer(req_id, f"failed: {msg}")
            raise (type(error) if isinstance(error, KVTransferError) else KVTransferError)(msg) from error
        # Every rank holds its part of the KV: the request decodes even if the producer cannot
        # be told (its store went away after the reads completed).
        self._tell_producer(req_id, "ok")
        assert plan is not None
        return ImportedRequest(req_id, ready.num_tokens, ready.first_token, moved, seconds, plan.src_ranks(), ndesc)
