"""The speculative decoding loop: propose, verify in one target step, accept, roll back.

Per request the runner keeps the committed tokens; the last one is not in the
target's cache yet (it is the first input of the next step). A round:

1. the proposer drafts k tokens per request (`proposer.DraftProposer`);
2. the target scores the last committed token and the k drafts in one step of
   k + 1 tokens per request (the "verify" batch kind: attention over the sharded
   cache with k + 1 queries per request, each query's rank-local causal length its
   own, any interleave);
3. `acceptance.greedy_accept` (temperature 0) or `acceptance.rejection_sample`
   picks a + 1 tokens per request;
4. rollback: the request now holds len(tokens) positions (the last one still
   pending), so `BlockAllocator.truncate` gives back every block past them, in the
   target's and the draft's cache alike (one allocator); the slots past them in a
   kept block are stale and never read, because each step writes every position it
   attends that is not cached, before attending it. `on_rollback` sees the stale
   positions (a test poisons them).

Without a proposer the same loop decodes one token per request and step, the
baseline that speculation must reproduce token for token under greedy decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.serving.spec_decode.acceptance import Accepted, greedy_accept, rejection_sample
from cp_compile.serving.spec_decode.proposer import DraftProposer
from cp_compile.base.sampling import Sampler, share


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


def _split(out: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    return (out[0], out[1]) if isinstance(out, tuple) else (out, None)


class SpecDecoder:
    """Greedy or sampled generation through `target(input_ids, positions, kv_caches, meta)`
    (logits [T, V], or (logits, hidden [T, D]) for an MTP proposer), with an optional
    proposer sharing `allocator`'s block tables."""

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

    def _target_step(self, reqs: list[tuple[int, int]], rids: list[int], ids: list[int]
                     ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        meta = build_attention_metadata(reqs, self.alloc, req_ids=rids, num_padding_tokens=self.padding,
                                        max_blocks_per_req=self.max_blocks_per_req, device=self.device)
        with torch.no_grad():
            logits, hidden = _split(self.target(torch.tensor(ids + [0] * self.padding, device=self.device),
                                                meta.positions, self.target_caches, meta))
        return logits, hidden, meta.query_start_loc.long().cpu()

    def _accept(self, drafts: torch.Tensor, draft_logits: torch.Tensor, target_logits: torch.Tensor) -> Accepted:
        if self.sampler.greedy:
            acc = greedy_accept(drafts, target_logits)
        else:
            acc = rejection_sample(drafts, self.sampler.probs(draft_logits).cpu(),
                                   self.sampler.probs(target_logits).cpu(), self.sampler.generator)
        packed = share(torch.cat([acc.num_accepted[:, None], acc.tokens], dim=1).cpu().contiguous())
        return Accepted(packed[:, 0], packed[:, 1:])

    def generate(self, prompts: dict[int, list[int]], max_new_tokens: int) -> SpecResult:
        """Every request prefills together, then rounds until each has max_new_tokens."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        tokens = {r: list(p) for r, p in prompts.items()}
        prompt_len = {r: len(p) for r, p in prompts.items()}
        stats = SpecStats()
        rids = sorted(tokens)
        # Prefill: every prompt token; the first generated token comes from the last one.
        logits, hidden, qsl = self._target_step([(0, len(tokens[r])) for r in rids], rids,
                                                [t for r in rids for t in tokens[r]])
        first = self.sampler.choose(logits[qsl[1:] - 1])
        hid = {r: hidden[qsl[i]:qsl[i + 1]] for i, r in enumerate(rids)} if hidden is not None else None
        for r, t in zip(rids, first.tolist()):
            tokens[r].append(t)
        done = lambda r: len(tokens[r]) - prompt_len[r] >= max_new_tokens  # noqa: E731
        while True:
            for r in [r for r in rids if done(r)]:
                self.alloc.free(r)
                if self.proposer is not None:
                    self.proposer.drop(r)
            rids = [r for r in rids if not done(r)]
            if not rids:
                break
            t0 = time.perf_counter()
            old_len = {r: len(tokens[r]) for r in rids}
            if self.proposer is None:
                drafts = torch.zeros(len(rids), 0, dtype=torch.int64)
                draft_logits = None
            else:
                drafts, draft_logits = self.proposer.propose(rids, tokens, hid, self.alloc, self.sampler,
                                                             self.device)
            ids = [t for i, r in enumerate(rids) for t in [tokens[r][-1]] + drafts[i].tolist()]
            logits, hidden, qsl = self._target_step([(old_len[r] - 1, self.k + 1) for r in rids], rids, ids)
            rows = logits[:qsl[-1]].view(len(rids), self.k + 1, -1)  # [B, k + 1, V]
            if self.proposer is None:
                acc = Accepted(torch.zeros(len(rids), dtype=torch.int64), self.sampler.choose(rows[:, 0])[:, None])
            else:
                acc = self._accept(drafts, draft_logits, rows)
            stats.steps += 1
            stats.request_steps += len(rids)
            stats.proposed += self.k * len(rids)
            stats.accepted += int(acc.num_accepted.sum())
            stats.accepted_per_step.append(acc.num_accepted.tolist())
            hid = {} if hidden is not None else None
            for i, r in enumerate(rids):
                new = acc.emitted(i)
                stats.emitted += len(new)
                tokens[r] += new
                a = len(new) - 1
                if hid is not None:
                    hid[r] = hidden[qsl[i]:qsl[i] + a + 1]  # positions old_len - 1 .. old_len - 1 + a
                self._rollback(r, old_len[r], a)
            stats.round_s.append(time.perf_counter() - t0)
            stats.round_tokens.append(sum(len(acc.emitted(i)) for i in range(len(rids))) / len(rids))
        out = {r: tokens[r][prompt_len[r]: prompt_len[r] + max_new_tokens] for r in prompts}
        return SpecResult(out, stats)

    def _rollback(self, r: int, old_len: int, a: int) -> None:
        """Request r wrote positions old_len - 1 .. old_len - 1 + k and kept a + 1 of them."""
        table = self.alloc.blocks(r)
        length = old_len + a + 1  # committed tokens; the last one (at length - 1) is pending
        target_stale = (length - 1, old_len - 1 + self.k)
        draft_stale = self.proposer.after_verify(r, old_len, a) if self.proposer is not None else (0, -1)
        freed = self.alloc.truncate(r, length)
        if self.on_rollback is not None:
            self.on_rollback(Rollback(r, old_len, a, table, target_stale, draft_stale, freed))
