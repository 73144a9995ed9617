"""PD disaggregation in the driver: `LLM(..., kv_transfer_config=...)`'s two roles.

    p = LLM(ckpt, tensor_parallel_size=2, kv_transfer_config={"kv_role": "kv_producer", "engine_id": "prefill-0",
            "kv_port": 5600, "kv_connector_extra_config": {"store_master": True}})
    d = LLM(ckpt, tensor_parallel_size=2, decode_context_parallel_size=2,
            kv_transfer_config={"kv_role": "kv_consumer", "engine_id": "decode-0", "kv_port": 5600,
                                "kv_connector_extra_config": {"remote_engine_id": "prefill-0"}})
    pre = p.generate(prompts, SamplingParams(temperature=0, max_tokens=1))     # prefill + export
    out = d.generate(prompts, SamplingParams(temperature=0, max_tokens=16),
                     kv_transfer_params=[o.kv_transfer_params for o in pre])  # import + decode

The two instances are separate process worlds (their own ranks, `init_parallel` and
process groups; any tp / pcp / dcp / interleave / block size each); what passes
between them is the vLLM-style `kv_transfer_params` of P's outputs and the KV, read
by each D rank over NIXL from the P ranks that hold its tokens (cp_compile.serving.kv_transfer).

Producer: a request is prefilled (max_tokens 1: the prefill's token), exported on
every rank (`kv_rank`), then held: its blocks stay reserved until the consumer's
verdict is in the store, checked before each step, when a waiting request needs the
blocks, and at `close`; or until the verdict cannot come any more (nobody claimed it
within `handoff_timeout_s`, or consumer ranks claimed it and then said nothing for
transfer_timeout_s + VERDICT_GRACE_S: `ProducerSide._overdue`). Consumer: a request with
`kv_transfer_params` is admitted like any other (its whole KV budget reserved),
imported on every rank before the step that would prefill it, and decodes from
`cached = prompt length` with P's token as its first output. A failed import (P
stalled or lost, geometry mismatch, ...) fails the request: the ranks freed its
blocks, the scheduler drops it, and `KVTransferError` / `ConfigError` reaches the caller.
An import that raises instead of answering fails its requests as well: the driver frees
their blocks on the ranks before the error reaches the caller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from cp_compile.serving.loop.scheduler import Scheduler, Sequence, StepPlan
from cp_compile.serving.kv_transfer import KVTransferConfig, KVTransferError
from cp_compile.serving.kv_transfer.exchange import Exchange
from cp_compile.base.sampling import RequestError, SamplingParams

_IDLE_S = 0.01
PARAM_KEYS = ("do_remote_prefill", "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
              "num_tokens")
# What vLLM's disaggregation proxy sends the prefill instance (its NIXL connector's
# request keys): "prefill here, a remote instance decodes". Values other than
# do_remote_decode are None there; they name nothing a producer needs.
PRODUCER_REQUEST_KEYS = ("do_remote_decode", "do_remote_prefill", "remote_engine_id", "remote_block_ids",
                         "remote_host", "remote_port")


def rank_config(kv: KVTransferConfig) -> dict:
    """The config the ranks get: the driver hosts the store (it lives as long as the LLM),
    so no rank is its master."""
    extra = dict(kv.kv_connector_extra_config, store_master=False)
    return dict(kv_role=kv.kv_role, kv_connector=kv.kv_connector, engine_id=kv.engine_id, kv_ip=kv.kv_ip,
                kv_port=kv.kv_port, kv_connector_extra_config=extra)


# After transfer_timeout_s, how much longer a consumer rank may still be on a request it
# claimed (its agreement and the verdict's store call) before the producer stops waiting.
VERDICT_GRACE_S = 5.0


@dataclass
class Held:
    seq: Sequence
    since: float
    claims: int = 0  # consumer-rank claims last seen (the producer looks once the verdict is late)
    claims_at: float = 0.0  # when `claims` was first seen at that count
    fenced_at: float | None = None  # when the producer expired it (later claims read nothing)


class ProducerSide:
    """The producer driver's ledger of exported requests (see module doc)."""

    def __init__(self, kv: KVTransferConfig) -> None:
        self.kv = kv
        # The driver hosts the store when store_master (before any rank connects to it).
        self.exchange = Exchange(kv.kv_ip, kv.kv_port, kv.engine_id, master=kv.store_master,
                                 timeout_s=kv.handoff_timeout_s, call_timeout_s=kv.transfer_timeout_s)
        self.held: dict[int, Held] = {}
        self.verdicts: dict[int, str] = {}  # rid -> the consumer's verdict ("ok", "failed: ...", "timeout")

    def check(self, n: int, params: SamplingParams, kv_params: Any) -> None:
        if kv_params is not None:  # only vLLM's proxy request {"do_remote_decode": true, ...}
            if not isinstance(kv_params, dict) or kv_params.get("do_remote_decode") is not True or \
                    kv_params.get("do_remote_prefill") or set(kv_params) - set(PRODUCER_REQUEST_KEYS):
                raise RequestError("kv_transfer_params", kv_params, "a kv_producer prefills its own requests and "
                                   "takes only vLLM's {'do_remote_decode': true} here (keys "
                                   f"{list(PRODUCER_REQUEST_KEYS)}). Fix: send a producer's kv_transfer_params "
                                   "to the kv_consumer instance")
        if params.max_tokens != 1:
            raise RequestError("max_tokens", params.max_tokens, "a kv_producer instance prefills only: its token "
                               "is the request's first; the consumer decodes the rest. Fix: "
                               "SamplingParams(max_tokens=1) on the producer")
        if params.n != 1:
            raise RequestError("n", params.n, "a kv_producer exports one request per prompt. Fix: n=1 here, "
                               "n samples on the consumer are n requests with their own transfers")

    def params_of(self, seq: Sequence) -> dict:
        return dict(do_remote_prefill=True, remote_engine_id=self.kv.engine_id, remote_request_id=seq.rid,
                    remote_host=self.kv.kv_ip, remote_port=self.kv.kv_port, num_tokens=len(seq.prompt))

    def after_commit(self, executor: Any, scheduler: Scheduler, finished: list[Sequence]) -> None:
        """Export the requests the step finished (every rank), hold their blocks."""
        done = [s for s in finished if s.finish_reason in ("length", "stop") and s.output]
        if not done:
            return
        executor.call("kv_export", [(s.rid, len(s.prompt), s.output[0]) for s in done])
        now = time.monotonic()
        for s in done:
            scheduler.hold(s)
            self.held[s.rid] = Held(s, now)
            s.payload.kv_transfer_params = self.params_of(s)

    def release_consumed(self, scheduler: Scheduler, wait_s: float = 0.0) -> int:
        """Free the held requests the consumer is done with, or whose verdict cannot come
        any more (`_overdue`); with wait_s, wait up to that long for the first one."""
        deadline = time.monotonic() + wait_s
        while True:
            released = 0
            for rid, h in list(self.held.items()):
                verdict = self.exchange.poll_consumed(rid)
                if verdict is not None and h.fenced_at is None:
                    # Fenced before its blocks go back: a replay of its kv_transfer_params (a
                    # consumer's retry after a failed verdict) is refused instead of reading them.
                    self.exchange.expire(rid)
                elif verdict is None:
                    verdict = self._overdue(rid, h, time.monotonic())
                if verdict is not None:
                    self.verdicts[rid] = verdict
                    scheduler.release(h.seq)
                    del self.held[rid]
                    released += 1
            if released or not self.held or time.monotonic() >= deadline:
                return released
            time.sleep(_IDLE_S)

    def _overdue(self, rid: int, h: Held, now: float) -> str | None:
        """Why a held request's verdict will not come (its blocks may be freed), or None.

        - Nobody claimed it within handoff_timeout_s: the producer fences it (expire) and
          frees it ("timeout").
        - Consumer ranks claimed it but no verdict came (its rank 0 could not reach the
          store, or the consumer died after its reads): a claimed rank's reads end within
          transfer_timeout_s of its claim, so once the claims have not moved for
          transfer_timeout_s + VERDICT_GRACE_S the producer fences it and frees it ("lost");
          a claim that slipped in before the fence gets that long again after it.
        Before this, a claimed request with no verdict was held forever: the expiry freed
        only unclaimed ones."""
        bound = self.kv.transfer_timeout_s + VERDICT_GRACE_S
        if h.fenced_at is not None:
            if now - h.fenced_at <= bound:
                return None
            return (f"lost: consumer ranks claimed it ({h.claims} claims) but no verdict came; freed "
                    f"transfer_timeout_s={self.kv.transfer_timeout_s} + {VERDICT_GRACE_S:g} s after it was expired")
        if now - h.since <= min(bound, self.kv.handoff_timeout_s):
            return None  # the usual case: the verdict follows the reads
        claims = self.exchange.claims(rid)
        if claims != h.claims:
            h.claims, h.claims_at = claims, now
        if claims == 0:
            if now - h.since <= self.kv.handoff_timeout_s:
                return None
        elif now - h.claims_at <= bound:
            return None
        before = self.exchange.expire(rid)
        if before == 0:
            return f"timeout: no consumer verdict within handoff_timeout_s={self.kv.handoff_timeout_s}"
        if before == h.claims and claims > 0:
            return (f"lost: consumer ranks claimed it ({claims} claims) but no verdict came within "
                    f"transfer_timeout_s={self.kv.transfer_timeout_s} + {VERDICT_GRACE_S:g} s of the last claim")
        h.claims, h.fenced_at = before, now  # a claim came just before the fence: its reads may still run
        return None

    def idle(self, scheduler: Scheduler) -> None:
        """Nothing could run: a waiting request needs blocks the held ones keep."""
        if self.held and scheduler.waiting:
            self.release_consumed(scheduler, wait_s=self.kv.handoff_timeout_s)

    def close(self, scheduler: Scheduler) -> None:
        """Before the ranks go: the consumer may still be reading held requests."""
        deadline = time.monotonic() + self.kv.handoff_timeout_s
        while self.held and time.monotonic() < deadline:
            self.release_consumed(scheduler, wait_s=deadline - time.monotonic())


@dataclass
class Imported:
    """A consumer request's transfer: what it reads, and (once read) what it got."""

    remote_request_id: int
    result: list[dict] = field(default_factory=list)  # per rank: bytes_moved, seconds, src_ranks, descriptors


class ConsumerSide:
    """The consumer driver's imports (see module doc)."""

    def __init__(self, kv: KVTransferConfig) -> None:
        self.kv = kv
        self.failed: dict[int, str] = {}  # rid -> the ranks' error
        self.imports: dict[int, list[dict]] = {}  # rid -> per rank: bytes_moved, seconds, src_ranks, descriptors

    def check(self, n: int, params: SamplingParams, kv_params: Any) -> Imported | None:
        if kv_params is None:
            return None  # prefilled here, as any request
        if not isinstance(kv_params, dict):
            raise RequestError("kv_transfer_params", type(kv_params).__name__, "is the dict a kv_producer's "
                               "RequestOutput.kv_transfer_params carries")
        unknown = sorted(set(kv_params) - set(PARAM_KEYS))
        if unknown:
            raise RequestError("kv_transfer_params", unknown, f"unknown keys; the keys are {list(PARAM_KEYS)}")
        engine = kv_params.get("remote_engine_id")
        if engine != self.kv.remote_engine_id:
            raise RequestError("kv_transfer_params.remote_engine_id", engine, "this consumer reads from "
                               f"{self.kv.remote_engine_id!r} (kv_connector_extra_config['remote_engine_id']). "
                               "Fix: send the request to the consumer of that producer")
        rid = kv_params.get("remote_request_id")
        if not isinstance(rid, int) or isinstance(rid, bool) or rid < 0:
            raise RequestError("kv_transfer_params.remote_request_id", rid, "is the producer's request id "
                               "(an int >= 0) from its RequestOutput.kv_transfer_params")
        if kv_params.get("num_tokens") != n:
            raise RequestError("kv_transfer_params.num_tokens", kv_params.get("num_tokens"),
                               f"the producer prefilled that many tokens but this prompt has {n}. Fix: send the "
                               "consumer the prompt the producer prefilled")
        if params.n != 1:
            raise RequestError("n", params.n, "a request decoded from transferred KV is one sample (the producer "
                               "sampled its first token). Fix: n=1")
        if params.logprobs is not None:
            raise RequestError("logprobs", params.logprobs, "the first token of a request decoded from "
                               "transferred KV was sampled by the producer, whose logits stay there. Fix: "
                               "logprobs=None, or ask the producer for them")
        return Imported(rid)

    def import_admitted(self, executor: Any, scheduler: Scheduler, plan: StepPlan) -> StepPlan:
        """Import every request just admitted with kv_transfer_params, before the step that
        would prefill it; returns the step's plan over what is left to run."""
        new = [s for s in scheduler.running
               if getattr(s.payload, "kv_import", None) is not None and not s.payload.kv_import.result]
        if not new:
            return plan
        if plan.free:  # the leavers' blocks must be free on the ranks before the imports allocate
            executor.execute(StepPlan([], plan.free))
        try:
            replies = executor.call("kv_import", [(s.payload.kv_import.remote_request_id, s.rid) for s in new])
        except BaseException as exc:
            # Not a verdict but a raise (a rank failed mid-import): the ranks may hold
            # blocks for these requests. They fail and their blocks are freed now; the
            # requests already running were not touched and go on.
            for s in new:
                self.failed[s.rid] = f"the import raised {type(exc).__name__}: {exc}"
            _fail_imports(executor, scheduler, new)
            raise
        failed = []
        for i, s in enumerate(new):
            errors = {r[i]["error"] for r in replies if r[i]["error"]}
            if errors:
                self.failed[s.rid] = replies[0][i]["error"] or sorted(errors)[0]
                failed.append(s)
                scheduler.abort(s.rid)
                continue
            s.payload.kv_import.result = self.imports[s.rid] = [r[i] for r in replies]
            first = replies[0][i]["first_token"]
            s.cached = len(s.prompt)
            s.tokens.append(first)
            if first in s.eos or len(s.output) >= s.max_tokens:
                scheduler.finish(s, "stop" if first in s.eos else "length")
            cb = s.payload.on_token
            if cb is not None:
                reason = cb(s)
                if reason is not None and s.finish_reason is None:
                    scheduler.finish(s, reason)
        if failed:
            raise KVTransferError("KV import failed (nothing of it is attended; its blocks are free): " + "; ".join(
                f"request {s.rid} (producer {self.kv.remote_engine_id!r}'s request "
                f"{s.payload.kv_import.remote_request_id}): {self.failed[s.rid]}" for s in failed))
        return StepPlan([(s.rid, s.cached, s.tokens[s.cached:]) for s in scheduler.running], [])


def _fail_imports(executor: Any, scheduler: Scheduler, seqs: list[Sequence]) -> None:
    """Drop requests whose import raised and free their blocks on the ranks (freeing
    what a rank never allocated is a no-op). A free that fails too is kept pending for
    the next plan; the import's own error is the one the caller sees."""
    for s in seqs:
        scheduler.abort(s.rid)
        s.finish_reason = "error"
    pending = scheduler.drain_free()
    try:
        executor.execute(StepPlan([], pending))
    except Exception:  # noqa: BLE001 - the ranks are gone
        scheduler._free.extend(pending)


def make_side(kv_transfer_config: Any) -> ProducerSide | ConsumerSide | None:
    if kv_transfer_config is None:
        return None
    kv = KVTransferConfig.from_dict(kv_transfer_config)
    return ProducerSide(kv) if kv.is_producer else ConsumerSide(kv)
