"""`StepLoop`, the one step loop: every front end that runs a model step runs it here.

    loop = StepLoop(executor, Scheduler(num_blocks, virtual_block_size, max_batch))
    loop.submit(Sequence(rid, prompt, max_tokens, payload=RequestState(params, generator)))
    loop.run_until_done()

One step: `Scheduler.plan()` (who runs, which blocks are freed or rolled back) ->
the proposer phase (`_propose`: speculative decoding's drafts join the plan's items;
none otherwise) -> `executor.execute(plan)` on the ranks (an `Executor`: the engine
itself in this process, the spawned ranks, a bare model forward, or speculative
decoding's target) -> `_choose`: the tokens each request commits, from the one
`cp_compile.base.sampling.Sampler` (per request here, with its params and generator;
per batch with acceptance in speculative decoding), rank 0's tokens shared (`share`)
-> `Scheduler.commit`.

Its callers: `hf.Engine.generate` (the engine as its executor, greedy params), the
driver of `LLM` and the server (`cp_compile.serving.entrypoints.driver.Driver`: request
checks and the PD-disaggregation hooks), speculative decoding
(`cp_compile.serving.spec_decode.runner.SpecLoop`: proposer phase, k + 1 logits per
item, acceptance) and `examples/serving.run_schedule` (a fixed join / leave schedule
over a bare forward).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from cp_compile.base.sampling import Logprob, Sampler, SamplingParams, share_tokens, token_logprobs
from cp_compile.serving.loop.scheduler import Scheduler, Sequence, StepPlan


class Executor(Protocol):
    """Runs one plan on every rank; returns rank 0's last-token logits [vocab] per item
    (a loop that overrides `_choose` may agree on another per-item output)."""

    def execute(self, plan: StepPlan) -> list[Any]: ...


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
    `_propose`, `_choose`, `_after_commit`) instead of writing a loop of their own."""

    def __init__(self, executor: Executor, scheduler: Scheduler, share: bool = False,
                 sampler: Sampler | None = None) -> None:
        self.executor = executor
        self.scheduler = scheduler
        # share: under torchrun every rank runs a loop on the same requests (SPMD); rank
        # 0's sampled tokens replace everyone's (`cp_compile.base.sampling.share`), so the
        # ranks still follow one sampler.
        self.share_tokens = share
        self.sampler = sampler or Sampler()
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
            run = self._propose(plan, running)  # the proposer phase: drafts join the items (spec decode)
            out = self.executor.execute(run)
            self.steps += 1
            if not running:
                return []
            tokens = self._choose(running, run, out)
            # The draft slots each item wrote: the ones past its committed tokens roll back.
            drafts = [len(r[2]) - len(p[2]) for r, p in zip(run.items, plan.items, strict=True)]
            self.scheduler.commit(tokens, drafts if any(drafts) else None)
            for seq in running:
                cb = getattr(seq.payload, "on_token", None)
                if cb is not None:  # also for a request that just finished: its last token's text
                    reason = cb(seq)
                    if reason is not None and seq.finish_reason is None:
                        self.scheduler.finish(seq, reason)
        except BaseException:
            self.fail(running, plan.free)
            raise
        self._after_commit(running)
        return running

    def _choose(self, running: list[Sequence], plan: StepPlan, out: list[Any]) -> list[int] | list[list[int]]:
        """The tokens each running request commits: one per request from its last-token
        logits `out[i]` [vocab], by its own params and generator (`Sampler.sample`);
        rank 0's tokens on every rank under `share`; logprobs / logits recorded."""
        tokens = [self.sampler.sample(lg, s.payload.params, s.payload.generator) for s, lg in zip(running, out)]
        if self.share_tokens:
            tokens = share_tokens(tokens)
        for s, lg, tok in zip(running, out, tokens):
            st: RequestState = s.payload
            if st.params.logprobs is not None:
                entry = token_logprobs(lg, tok, st.params.logprobs)
                st.logprobs.append(entry)
                st.cumulative_logprob += entry[tok].logprob
            if st.logits is not None:
                st.logits.append(lg)
        return tokens

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

    def _propose(self, plan: StepPlan, running: list[Sequence]) -> StepPlan:
        """The proposer phase: the plan with each decoding item's draft tokens appended
        (speculative decoding); the plan itself otherwise."""
        return plan

    def _after_commit(self, running: list[Sequence]) -> None:
        pass
