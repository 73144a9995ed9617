"""Continuous batching, host side only: which requests run each step, when they
join and leave. No tensors, no collectives: the driver (one process) owns it and
ships each step as a `StepPlan`; every rank's `Engine.execute(plan)` applies the same
plan, so the ranks' block allocators stay identical without talking to each other.

A request joins when a batch slot (`max_batch`) and its whole KV budget
(prompt + max_tokens, so no preemption is ever needed) are free; a joining prompt
rides in the same step as the running decodes (one flattened batch). A request
leaves at max_tokens, EOS (unless ignore_eos), a stop token, or when aborted (a
disconnected client): its blocks are freed by the next plan.

The step loop is factored as `plan() -> execute -> commit(tokens)` so a role that
only prefills (PD disaggregation: the plan's requests leave after their first
token) or decodes from imported KV (the plan starts at `cached = prompt length`)
is a different plan, not a different engine.

`StepLoop` is that loop, the one every non-speculative front end steps through:
plan, execute on the ranks (an `Executor`: the engine itself in this process, or
the spawned ranks), sample each request's token (`cp_compile.base.sampling.Sampler`, per
request; rank 0's tokens shared under torchrun), commit. `hf.Engine.generate` runs
it with the engine as its executor and greedy params; the driver of `LLM` and the
server (`cp_compile.serving.entrypoints.driver.Driver`) is a `StepLoop` that adds request
checks and the PD-disaggregation hooks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from cp_compile.base.sampling import Logprob, Sampler, SamplingParams, share_tokens, token_logprobs


@dataclass
class StepPlan:
    """items: (request id, tokens already cached, new token ids) per request, in batch
    order; free: request ids whose blocks to release before the step."""

    items: list[tuple[int, int, list[int]]]
    free: list[int] = field(default_factory=list)


@dataclass
class Sequence:
    rid: int
    prompt: list[int]
    max_tokens: int
    eos: frozenset[int] = frozenset()
    payload: Any = None  # the front end's own state (sampling params, generator, text, ...)
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def budget(self) -> int:
        return len(self.prompt) + self.max_tokens


class Scheduler:
    """`add` / `abort` requests, `plan()` the next step, `commit` its tokens."""

    def __init__(self, num_blocks: int, virtual_block_size: int, max_batch: int) -> None:
        self.num_blocks = num_blocks
        self.vbs = virtual_block_size
        self.max_batch = max_batch
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0
        self._free: list[int] = []

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.vbs)

    def add(self, seq: Sequence) -> None:
        if self.blocks_for(seq.budget) > self.num_blocks:
            raise ValueError(f"request {seq.rid}: {len(seq.prompt)} prompt tokens + max_tokens={seq.max_tokens} "
                             f"need {self.blocks_for(seq.budget)} KV blocks of {self.vbs} tokens; the cache has "
                             f"{self.num_blocks}. Fix: fewer tokens, or more KV blocks / a larger dcp")
        self.waiting.append(seq)

    def abort(self, rid: int) -> bool:
        """Drop a request wherever it is; its blocks are freed by the next plan."""
        for seq in list(self.waiting):
            if seq.rid == rid:
                self.waiting.remove(seq)
                seq.finish_reason = "abort"
                return True
        for seq in self.running:
            if seq.rid == rid:
                self._leave(seq, "abort")
                self.running.remove(seq)
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def plan(self, may_join: Any = None) -> StepPlan | None:
        """Admit what fits, then the batch of this step (None: nothing to run yet).
        `may_join(seq) -> bool` delays joins (tests)."""
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            if may_join is not None and not may_join(seq):
                break
            need = self.blocks_for(seq.budget)
            if self.reserved + need > self.num_blocks:
                break
            self.waiting.popleft()
            self.reserved += need
            self.running.append(seq)
        free = self.drain_free()
        if not self.running:
            return StepPlan([], free) if free else None
        return StepPlan([(s.rid, s.cached, s.tokens[s.cached:]) for s in self.running], free)

    def commit(self, tokens: list[int]) -> list[Sequence]:
        """The next token of each running request (plan order); returns those that finished."""
        done, still = [], []
        for seq, tok in zip(self.running, tokens, strict=True):
            seq.cached = len(seq.tokens)
            seq.tokens.append(tok)
            reason = ("stop" if tok in seq.eos else "length" if len(seq.output) >= seq.max_tokens else None)
            if reason is not None:
                self._leave(seq, reason)
                done.append(seq)
            else:
                still.append(seq)
        self.running = still
        return done

    def drain_free(self) -> list[int]:
        """Request ids left since the last plan (for a final `StepPlan([], free)`)."""
        free, self._free = self._free, []
        return free

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a running request early (a stop string seen by the front end)."""
        if seq in self.running:
            self.running.remove(seq)
            self._leave(seq, reason)

    def hold(self, seq: Sequence) -> None:
        """Keep a request that just left on its blocks (PD disaggregation: a producer's
        prefilled request until the consumer has read it): reserved again and not freed
        by the next plan, until `release`."""
        self._free.remove(seq.rid)
        self.reserved += self.blocks_for(seq.budget)

    def release(self, seq: Sequence) -> None:
        """Free a held request's blocks with the next plan."""
        self.reserved -= self.blocks_for(seq.budget)
        self._free.append(seq.rid)

    def _leave(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.reserved -= self.blocks_for(seq.budget)
        self._free.append(seq.rid)


class Executor(Protocol):
    """Runs one plan on every rank; returns rank 0's last-token logits [vocab] per item."""

    def execute(self, plan: StepPlan) -> list[torch.Tensor]: ...


@dataclass
class RequestState:
    """The step loop's per-request state (`Sequence.payload`)."""

    params: SamplingParams
    generator: torch.Generator | None
    on_token: Callable[[Sequence], str | None] | None = None  # -> a finish reason to stop early (stop strings)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per output token, when params.logprobs
    cumulative_logprob: float = 0.0
    logits: list[torch.Tensor] | None = None  # each output token's logits [vocab], when recorded (a list)


class StepLoop:
    """The one step loop (module doc): `submit` requests, `step()` until `has_work()`
    is false. Subclasses hook into a step (`_before_plan`, `_admitted`, `_idle`,
    `_after_commit`) instead of writing a loop of their own."""

    def __init__(self, executor: Executor, scheduler: Scheduler, share: bool = False) -> None:
        self.executor = executor
        self.scheduler = scheduler
        # share: under torchrun every rank runs a loop on the same requests (SPMD); rank
        # 0's sampled tokens replace everyone's (`cp_compile.base.sampling.share`), so the
        # ranks still follow one sampler.
        self.share_tokens = share
        self.sampler = Sampler()
        self.steps = 0

    def submit(self, seq: Sequence) -> Sequence:
        """Queue a request whose payload is a `RequestState`."""
        self.scheduler.add(seq)
        return seq

    def has_work(self) -> bool:
        # Requests that left still hold blocks until a plan carries their ids.
        return self.scheduler.has_work() or bool(self.scheduler._free)

    def drop(self, seqs: list[Sequence]) -> None:
        """Drop these requests (after an error) and free what left, now: the allocator on
        the ranks gets back every block they took, whatever step failed."""
        for s in seqs:
            if s.finish_reason is None:
                self.scheduler.abort(s.rid)
        self.executor.execute(StepPlan([], self.scheduler.drain_free()))

    def step(self, may_join: Callable[[Sequence], bool] | None = None) -> list[Sequence]:
        """One step on every rank; returns the requests that got a token (or finished).
        `may_join(seq)`: whether a waiting request may join this step (arrivals). A step
        that raises at execution or sampling fails the requests it ran (`fail`) first."""
        self._before_plan()
        plan = self.scheduler.plan(may_join)
        if plan is None:
            self._idle()
            return []
        plan = self._admitted(plan)  # a hook that raises cleans up what it touched (kv_driver)
        running = list(self.scheduler.running)
        try:
            last = self.executor.execute(plan)
            self.steps += 1
            if not running:
                return []
            tokens = [self.sampler.sample(lg, s.payload.params, s.payload.generator) for s, lg in zip(running, last)]
            if self.share_tokens:
                tokens = share_tokens(tokens)
            for s, lg, tok in zip(running, last, tokens):
                st: RequestState = s.payload
                if st.params.logprobs is not None:
                    entry = token_logprobs(lg, tok, st.params.logprobs)
                    st.logprobs.append(entry)
                    st.cumulative_logprob += entry[tok].logprob
                if st.logits is not None:
                    st.logits.append(lg)
            self.scheduler.commit(tokens)
            for seq in running:
                cb = seq.payload.on_token
                if cb is not None:  # also for a request that just finished: its last token's text
                    reason = cb(seq)
                    if reason is not None and seq.finish_reason is None:
                        self.scheduler.finish(seq, reason)
        except BaseException:
            self.fail(running, plan.free)
            raise
        self._after_commit(running)
        return running

    def fail(self, seqs: list[Sequence], free: list[int] | None = None) -> None:
        """A step that ran `seqs` raised: they cannot go on (their KV or sampler state may
        be half a step ahead), so they leave with finish_reason "error" and every block
        they hold goes back on the ranks now, with `free` (the failed plan's leavers,
        which the ranks may not have freed yet; freeing twice is a no-op). Requests the
        step did not run stay as they were."""
        for s in seqs:
            if s.finish_reason is None:
                self.scheduler.abort(s.rid)
                s.finish_reason = "error"
        pending = list(free or []) + self.scheduler.drain_free()
        try:
            self.executor.execute(StepPlan([], pending))
        except Exception:  # noqa: BLE001 - the ranks are gone: the step's own error is the one to see
            # Kept pending: the next plan (or `drop`) frees them if the ranks come back.
            self.scheduler._free.extend(r for r in pending if r not in self.scheduler._free)

    def run_until_done(self, progress: Callable[[list[Sequence]], None] | None = None,
                       may_join: Callable[[Sequence], bool] | None = None) -> None:
        while self.has_work():
            updated = self.step(may_join)
            if progress is not None:
                progress(updated)

    # ---- hooks (PD disaggregation in the driver); no-ops here ----------------------
    def _before_plan(self) -> None:
        pass

    def _idle(self) -> None:
        """Nothing to run this step."""

    def _admitted(self, plan: StepPlan) -> StepPlan:
        """The plan to execute (a consumer imports the admitted requests' KV first)."""
        return plan

    def _after_commit(self, running: list[Sequence]) -> None:
        pass
