"""Speculative decoding through the one step loop (`cp_compile.serving.loop.step_loop.StepLoop`).

Per request the loop's `Sequence` keeps the committed tokens; the last one is not in
the target's cache yet (it is the first input of the next step). A step of
`SpecLoop`:

1. plan: the scheduler (`draft_slots=k`: a request joins only when its blocks cover
   its k draft slots) carries the previous step's frees and rollbacks;
2. proposer phase (`SpecExecutor.propose`, on this rank): the rollbacks are applied
   first, then the proposer drafts k tokens per decoding request
   (`proposer.DraftProposer`), appended to its plan item (k + 1 tokens);
3. execute: the target scores the items in one step (the "verify" batch kind:
   attention over the sharded cache with k + 1 queries per decoding request, each
   query's rank-local causal length its own, any interleave; a joining request's
   prompt rides beside them) and returns each item's k + 1 (or, for a prompt, 1)
   last logits, and the target's hidden states for an MTP proposer;
4. choose: `acceptance.greedy_accept` (temperature 0) or `acceptance.rejection_sample`
   with the one `Sampler` and its seeded generator picks a + 1 tokens per decoding
   request, a prompt's first token is the `Sampler`'s; rank 0's tokens on every rank
   (`share`, one broadcast per batch);
5. commit: the scheduler appends the a + 1 tokens and records the rollback; the next
   plan's `truncate` makes `BlockAllocator.truncate` give back every block past the
   committed tokens, in the target's and the draft's cache alike (one allocator);
   the slots past them in a kept block are stale and never read, because each step
   writes every position it attends that is not cached, before attending it.
   `on_rollback` sees the stale positions (a test poisons them).

Without a proposer the same loop decodes one token per request and step, the
baseline that speculation must reproduce token for token under greedy decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from cp_compile.base.sampling import Sampler, share
from cp_compile.runtime.metadata_build import BlockAllocator
from cp_compile.serving.loop.forward_executor import ForwardExecutor
from cp_compile.serving.loop.scheduler import Scheduler, StepPlan
from cp_compile.serving.loop.scheduler import Sequence as Request
from cp_compile.serving.loop.step_loop import StepLoop
from cp_compile.serving.spec_decode.acceptance import Accepted, greedy_accept, rejection_sample
from cp_compile.serving.spec_decode.proposer import DraftProposer


@dataclass
class Rollback:
    """After a verify step of request `req_id` (old_len committed tokens before it,
    num_accepted drafts accepted): the block table before truncation, the stale
    positions [first, last] of the target's and of the draft's cache, and the blocks
    given back."""

    req_id: int
    old_len: int
    num_accepted: int
    block_table: list[int]
    target_stale: tuple[int, int]
    draft_stale: tuple[int, int]
    freed: list[int]


@dataclass
class SpecStats:
    """Counts over the verify (or, without speculation, decode) steps."""

    steps: int = 0  # target steps after the prefill
    request_steps: int = 0  # sum over steps of the requests in it
    proposed: int = 0  # draft tokens scored
    accepted: int = 0  # draft tokens accepted
    emitted: int = 0  # tokens the steps emitted (accepted + one per request and step)
    accepted_per_step: list[list[int]] = field(default_factory=list)
    round_s: list[float] = field(default_factory=list)  # wall seconds of each round (draft + verify + accept)
    round_tokens: list[float] = field(default_factory=list)  # tokens per request emitted by each round

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens per request and target step (1 without speculation, up to k + 1)."""
        return self.emitted / self.request_steps if self.request_steps else 0.0

    def tpot_s(self, skip: int = 0) -> float:
        """Seconds per output token of a request over the rounds after the first `skip`:
        round time / tokens per request it emitted, pooled over rounds."""
        t, n = sum(self.round_s[skip:]), sum(self.round_tokens[skip:])
        return t / n if n else float("nan")


@dataclass
class SpecResult:
    tokens: dict[int, list[int]]  # request -> generated tokens (prompt excluded), max_new_tokens of them
    stats: SpecStats


@dataclass
class Scored:
    """One plan item's output of the target: logits [n, V] of its last n positions (k + 1
    for a decoding request with drafts, else 1); draft_logits [k, V] of its drafts, or
    None when it had none."""

    logits: torch.Tensor
    draft_logits: torch.Tensor | None = None


class SpecExecutor(ForwardExecutor):
    """The target on this rank (every rank runs its own `SpecLoop` on the same
    requests), with the proposer phase and the rollback of rejected draft slots."""

    def __init__(self, target: Callable[..., Any], target_caches: Sequence[tuple[torch.Tensor, ...]],
                 alloc: BlockAllocator, proposer: DraftProposer | None, sampler: Sampler, padding: int = 0,
                 max_blocks_per_req: int | None = None, device: torch.device | str = "cpu",
                 on_rollback: Callable[[Rollback], None] | None = None) -> None:
        super().__init__(target, target_caches, alloc, padding, max_blocks_per_req, device)
        self.proposer = proposer
        self.sampler = sampler
        self.on_rollback = on_rollback
        self.k = proposer.k if proposer is not None else 0
        self.hidden: dict[int, torch.Tensor] = {}  # request -> the target's hidden states of its last step (MTP)
        self.old_len: dict[int, int] = {}  # request -> committed tokens before its verify step in flight
        self.draft_logits: dict[int, torch.Tensor] = {}  # request -> [k, V] of this step's drafts

    def _free(self, rid: int) -> None:
        self.alloc.free(rid)
        self.hidden.pop(rid, None)
        self.old_len.pop(rid, None)
        if self.proposer is not None:
            self.proposer.drop(rid)

    def _truncate(self, rid: int, keep: int) -> None:
        """Request `rid` wrote positions old_len - 1 .. old_len - 1 + k and kept the
        `keep` = old_len + a + 1 tokens (the last one pending): the rollback."""
        old_len = self.old_len.pop(rid)
        a = keep - old_len - 1
        table = self.alloc.blocks(rid)
        draft_stale = self.proposer.after_verify(rid, old_len, a) if self.proposer is not None else (0, -1)
        freed = self.alloc.truncate(rid, keep)
        if rid in self.hidden:  # positions old_len - 1 .. old_len - 1 + a: the MTP's next catch-up
            self.hidden[rid] = self.hidden[rid][:a + 1]
        if self.on_rollback is not None:
            self.on_rollback(Rollback(rid, old_len, a, table, (keep - 1, old_len - 1 + self.k), draft_stale, freed))

    def propose(self, plan: StepPlan, tokens: dict[int, list[int]]) -> StepPlan:
        """The proposer phase: the plan's frees and rollbacks first (the draft catch-up
        reads the blocks they change), then k drafts for each request of `tokens` (its
        committed tokens; the last one pending) appended to its item."""
        plan = self.release(plan)
        if self.proposer is None or not tokens:
            return plan
        rids = [rid for rid, _, _ in plan.items if rid in tokens]
        drafts, draft_logits = self.proposer.propose(rids, tokens, self.hidden or None, self.alloc, self.sampler,
                                                     self.device)  # [B, k], [B, k, V]
        row = {r: i for i, r in enumerate(rids)}
        items = []
        for rid, cached, new in plan.items:
            if rid in row:
                self.old_len[rid] = len(tokens[rid])
                self.draft_logits[rid] = draft_logits[row[rid]]
                new = new + drafts[row[rid]].tolist()
            items.append((rid, cached, new))
        return StepPlan(items)

    def execute(self, plan: StepPlan) -> list[Scored]:  # type: ignore[override]
        plan = self.release(plan)
        if not plan.items:
            return []
        logits, hidden, qsl = self.run(plan)
        out = []
        for i, (rid, _, _) in enumerate(plan.items):
            start, end = int(qsl[i]), int(qsl[i + 1])
            if hidden is not None:
                self.hidden[rid] = hidden[start:end]
            draft_logits = self.draft_logits.pop(rid, None)
            n = 1 if draft_logits is None else self.k + 1
            out.append(Scored(logits[end - n:end], draft_logits))
        return out


class SpecLoop(StepLoop):
    """The step loop with a proposer phase and acceptance (module doc); counts `stats`."""

    def __init__(self, executor: SpecExecutor, scheduler: Scheduler, sampler: Sampler, stats: SpecStats) -> None:
        super().__init__(executor, scheduler, sampler=sampler)
        self.executor: SpecExecutor = executor
        self.stats = stats
        self._t0 = 0.0
        self._decoding: set[int] = set()

    def _propose(self, plan: StepPlan, running: list[Request]) -> StepPlan:
        self._t0 = time.perf_counter()
        decoding = [s for s in running if s.output]  # a first token: its prompt is cached
        self._decoding = {s.rid for s in decoding}
        return self.executor.propose(plan, {s.rid: s.tokens for s in decoding})

    def _accept(self, drafts: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> Accepted:
        if self.sampler.greedy:
            acc = greedy_accept(drafts, target_logits)
        else:
            acc = rejection_sample(drafts, self.sampler.probs(draft_logits).cpu(),
                                   self.sampler.probs(target_logits).cpu(), self.sampler.generator)
        packed = share(torch.cat([acc.num_accepted[:, None], acc.tokens], dim=1).cpu().contiguous())
        return Accepted(packed[:, 0], packed[:, 1:])

    def _choose(self, running: list[Request], plan: StepPlan, out: list[Scored]) -> list[list[int]]:
        """A prompt's first token from its last logits; a decoding request's a + 1 tokens
        from acceptance over its k drafts (without a proposer: k = 0, one token)."""
        tokens: list[list[int]] = [[] for _ in running]
        first = [i for i, s in enumerate(running) if s.rid not in self._decoding]
        if first:
            for i, t in zip(first, self.sampler.choose(torch.stack([out[i].logits[-1] for i in first])).tolist()):
                tokens[i] = [t]
        dec = [i for i, s in enumerate(running) if s.rid in self._decoding]
        if not dec:
            return tokens
        k = self.executor.k
        rows = torch.stack([out[i].logits for i in dec])  # [B, k + 1, V]
        if k == 0:
            acc = Accepted(torch.zeros(len(dec), dtype=torch.int64), self.sampler.choose(rows[:, 0])[:, None])
        else:
            drafts = torch.tensor([plan.items[i][2][1:] for i in dec], dtype=torch.int64)  # [B, k]
            acc = self._accept(drafts, torch.stack([out[i].draft_logits for i in dec]), rows)
        st = self.stats
        st.steps += 1
        st.request_steps += len(dec)
        st.proposed += k * len(dec)
        st.accepted += int(acc.num_accepted.sum())
        st.accepted_per_step.append(acc.num_accepted.tolist())
        emitted = [acc.emitted(j) for j in range(len(dec))]
        st.emitted += sum(map(len, emitted))
        st.round_tokens.append(sum(map(len, emitted)) / len(dec))
        for i, new in zip(dec, emitted):
            tokens[i] = new
        return tokens

    def _after_commit(self, running: list[Request]) -> None:
        if self._decoding:  # a round: draft + verify + accept + commit
            self.stats.round_s.append(time.perf_counter() - self._t0)


class SpecDecoder:
    """Greedy or sampled generation through `target(input_ids, positions, kv_caches, meta)`
    (logits [T, V], or (logits, hidden [T, D]) for an MTP proposer), with an optional
    proposer sharing `allocator`'s block tables, stepped by `SpecLoop`."""

    def __init__(self, target: Callable[..., Any], target_caches: Sequence[tuple[torch.Tensor, ...]],
                 allocator: BlockAllocator, proposer: DraftProposer | None = None, sampler: Sampler | None = None,
                 padding: int = 0, max_blocks_per_req: int | None = None, device: torch.device | str = "cpu",
                 on_rollback: Callable[[Rollback], None] | None = None) -> None:
        self.target = target
        self.target_caches = target_caches
        self.alloc = allocator
        self.proposer = proposer
        self.sampler = sampler or Sampler()
        self.padding = padding
        self.max_blocks_per_req = max_blocks_per_req
        self.device = device
        self.on_rollback = on_rollback
        self.k = proposer.k if proposer is not None else 0

    def generate(self, prompts: dict[int, list[int]], max_new_tokens: int) -> SpecResult:
        """Every request joins at once while its blocks (prompt + max_new_tokens + the
        draft slots) fit, the rest as blocks come back; each generates max_new_tokens."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        stats = SpecStats()
        executor = SpecExecutor(self.target, self.target_caches, self.alloc, self.proposer, self.sampler,
                                self.padding, self.max_blocks_per_req, self.device, self.on_rollback)
        scheduler = Scheduler(self.alloc.num_free, self.alloc.block_tokens, max_batch=max(len(prompts), 1),
                              draft_slots=self.k)
        loop = SpecLoop(executor, scheduler, self.sampler, stats)
        seqs = {r: loop.submit(Request(r, list(prompts[r]), max_new_tokens)) for r in sorted(prompts)}
        loop.run_until_done()
        return SpecResult({r: seqs[r].output for r in prompts}, stats)
