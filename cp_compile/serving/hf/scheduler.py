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
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any


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
