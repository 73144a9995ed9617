"""Continuous batching, host side only: which requests run each step, when they
join and leave. No tensors, no collectives: the loop (`step_loop.StepLoop`, in one
process) owns it and ships each step as a `StepPlan`; every rank's executor applies
the same plan, so the ranks' block allocators stay identical without talking to each
other.

A request joins when a batch slot (`max_batch`) and its whole KV budget (prompt +
max_tokens, plus the draft slots of speculative decoding, so no preemption is ever
needed) are free; a joining prompt rides in the same step as the running decodes
(one flattened batch). A request leaves at max_tokens, EOS (unless ignore_eos), a
stop token, or when aborted (a disconnected client): its blocks are freed by the
next plan.

Speculative decoding (`draft_slots` = k): a step may write k draft positions past a
request's committed tokens and commit only a + 1 tokens (a accepted drafts); the
rejected slots are rolled back by the next plan (`StepPlan.truncate`: the blocks
past the committed tokens go back), so the rollback travels with the plan like the
frees and every rank's allocator follows it.

The step is factored as `plan() -> execute -> commit(tokens)` so a role that only
prefills (PD disaggregation: the plan's requests leave after their first token) or
decodes from imported KV (the plan starts at `cached = prompt length`) is a
different plan, not a different engine.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepPlan:
    """items: (request id, tokens already cached, new token ids) per request, in batch
    order (with speculative decoding, a decoding request's new tokens are its pending
    token and k drafts); free: request ids whose blocks to release before the step;
    truncate: (request id, tokens kept) of the requests whose last step wrote rejected
    draft slots, to shrink to the blocks those tokens need before the step (rollback)."""

    items: list[tuple[int, int, list[int]]]
    free: list[int] = field(default_factory=list)
    truncate: list[tuple[int, int]] = field(default_factory=list)


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

    def __init__(self, num_blocks: int, virtual_block_size: int, max_batch: int, draft_slots: int = 0) -> None:
        self.num_blocks = num_blocks
        self.vbs = virtual_block_size
        self.max_batch = max_batch
        # Speculative decoding: k drafts per step. The last step of a request starts with
        # budget - 1 committed tokens and writes k more positions, so it holds up to
        # budget - 1 + k positions: its reservation covers them.
        self.draft_slots = draft_slots
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.reserved = 0
        self._free: list[int] = []
        self._truncate: list[tuple[int, int]] = []

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.vbs)

    def need(self, seq: Sequence) -> int:
        """The KV blocks `seq` holds at most: its budget and its draft slots."""
        return self.blocks_for(seq.budget + max(self.draft_slots - 1, 0))

    def add(self, seq: Sequence) -> None:
        if self.need(seq) > self.num_blocks:
            drafts = f" + {self.draft_slots - 1} draft slots" if self.draft_slots > 1 else ""
            raise ValueError(f"request {seq.rid}: {len(seq.prompt)} prompt tokens + max_tokens={seq.max_tokens}"
                             f"{drafts} need {self.need(seq)} KV blocks of {self.vbs} tokens; the cache has "
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
            need = self.need(seq)
            if self.reserved + need > self.num_blocks:
                break
            self.waiting.popleft()
            self.reserved += need
            self.running.append(seq)
        free = self.drain_free()
        running = {s.rid for s in self.running}
        truncate, self._truncate = [t for t in self._truncate if t[0] in running], []
        if not self.running:
            return StepPlan([], free) if free else None
        return StepPlan([(s.rid, s.cached, s.tokens[s.cached:]) for s in self.running], free, truncate)

    def commit(self, tokens: list[int] | list[list[int]], drafts: list[int] | None = None) -> list[Sequence]:
        """The tokens of each running request (plan order): one int, or a list (speculative
        decoding: the a accepted drafts and the target's token); returns those that
        finished. `drafts[i]`: the draft slots item i's step wrote; a request that goes on
        is rolled back to its committed tokens by the next plan (`StepPlan.truncate`)."""
        done, still = [], []
        for i, (seq, new) in enumerate(zip(self.running, tokens, strict=True)):
            reason = None
            for tok in [new] if isinstance(new, int) else new:
                seq.tokens.append(tok)
                reason = ("stop" if tok in seq.eos else "length" if len(seq.output) >= seq.max_tokens else None)
                if reason is not None:  # tokens past a stop or the length are dropped
                    break
            # Every token but the last is in the cache now; the last is the next step's input.
            seq.cached = len(seq.tokens) - 1
            if reason is not None:
                self._leave(seq, reason)
                done.append(seq)
            else:
                still.append(seq)
                if drafts is not None and drafts[i] > 0:
                    self._truncate.append((seq.rid, len(seq.tokens)))
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
        self.reserved += self.need(seq)

    def release(self, seq: Sequence) -> None:
        """Free a held request's blocks with the next plan."""
        self.reserved -= self.need(seq)
        self._free.append(seq.rid)

    def _leave(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.reserved -= self.need(seq)
        self._free.append(seq.rid)
