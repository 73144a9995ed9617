"""Draft proposers: k tokens per request from a small model or an MTP layer.

A proposer is a model with its own KV cache, allocated like the target's
(`allocate_kv_cache` with the same config: sharded over the same pcp * dcp ranks)
and indexed by the *same* block tables: it shares the target's `BlockAllocator`, so
a draft token at position p lands in the slot the target's token at p uses, and
the rollback that gives the target's blocks back gives the draft's back too.

Each round runs k draft steps. The first catches up on the tokens the target
committed since the last round (a prefill for a new request, 1 .. k + 1 tokens per
request otherwise: the "verify" batch kind), the other k - 1 feed one draft token
per request (decode). Two kinds of draft model:

- a token model (`uses_target_hidden=False`, a small GQA model): position p takes
  token p and predicts p + 1; its entries are exact while their inputs are
  committed tokens, so after a round with `a` accepts it keeps min(a, k - 1) of the
  draft positions it wrote;
- an MTP layer (`uses_target_hidden=True`, DeepSeek-V3): position p takes the
  target's hidden state at p and token p + 1, and predicts p + 2; its later draft
  steps feed its own hidden state instead of the target's, so only the positions fed
  by the target are kept and the accepted ones are recomputed with the target's
  hidden states in the next catch-up (as vLLM's MTP proposer does).

`forward(input_ids, positions, kv_caches, meta) -> logits [T, V]` (token model) or
`forward(input_ids, positions, hidden, kv_caches, meta) -> (logits [T, V], hidden [T, D])`
(MTP), compiled or not.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.base.sampling import Sampler


class DraftProposer:
    """k draft tokens per request per round from `forward` over `kv_caches`."""

    def __init__(self, forward: Callable[..., Any], kv_caches: Sequence[tuple[torch.Tensor, ...]],
                 num_speculative_tokens: int, *, uses_target_hidden: bool, padding: int = 0,
                 max_blocks_per_req: int | None = None) -> None:
        if isinstance(num_speculative_tokens, bool) or not isinstance(num_speculative_tokens, int) \
                or num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens={num_speculative_tokens!r} must be an integer >= 1. Fix: "
                             f"pass the number of draft tokens per request and step")
        self.forward = forward
        self.kv_caches = kv_caches
        self.k = num_speculative_tokens
        self.uses_target_hidden = uses_target_hidden
        self.shift = 1 if uses_target_hidden else 0  # position p feeds token p + shift
        self.padding = padding
        self.max_blocks_per_req = max_blocks_per_req
        self.valid: dict[int, int] = {}  # request -> positions of the draft cache that are exact
        self._written_end: dict[int, int] = {}  # request -> last position written this round

    def _run(self, ids: list[int], reqs: list[tuple[int, int]], rids: list[int], hidden: torch.Tensor | None,
             alloc: BlockAllocator, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft step; the logits (and hidden states) of each request's last token."""
        meta = build_attention_metadata(reqs, alloc, req_ids=rids, num_padding_tokens=self.padding,
                                        max_blocks_per_req=self.max_blocks_per_req, device=device)
        input_ids = torch.tensor(ids + [0] * self.padding, device=device)
        with torch.no_grad():
            if self.uses_target_hidden:
                assert hidden is not None
                pad = hidden.new_zeros(self.padding, hidden.shape[-1])
                logits, h = self.forward(input_ids, meta.positions, torch.cat([hidden, pad]), self.kv_caches, meta)
            else:
                logits, h = self.forward(input_ids, meta.positions, self.kv_caches, meta), None
        last = meta.query_start_loc[1:].long() - 1  # [B]
        return logits[last], (h[last] if h is not None else None)

    def propose(self, rids: list[int], tokens: dict[int, list[int]], target_hidden: dict[int, torch.Tensor] | None,
                alloc: BlockAllocator, sampler: Sampler, device: torch.device | str = "cpu"
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft tokens [B, k] int64 (the same on every rank) and their logits [B, k, V].

        tokens[r]: request r's committed tokens (the last one not yet in the target's
        cache); target_hidden[r] (MTP): the target's hidden states [n, D] of its last
        step, for positions len(tokens[r]) - 1 - n .. len(tokens[r]) - 2.
        """
        ids, reqs, hid = [], [], []
        for r in rids:
            start, end = self.valid.get(r, 0), len(tokens[r]) - self.shift  # positions start .. end - 1
            ids += tokens[r][start + self.shift: end + self.shift]
            reqs.append((start, end - start))
            if self.uses_target_hidden:
                h = target_hidden[r]  # type: ignore[index]
                if h.shape[0] < end - start:
                    raise RuntimeError(f"request {r}: the MTP layer needs the target's hidden states of positions "
                                       f"{start} .. {end - 1} but got {h.shape[0]} rows. Fix: pass the hidden "
                                       f"states of the target's last step for every request")
                hid.append(h[h.shape[0] - (end - start):])
        hidden = torch.cat(hid) if hid else None
        drafts, all_logits = [], []
        for j in range(self.k):
            logits, h = self._run(ids, reqs, rids, hidden, alloc, device)  # [B, V], [B, D]
            d = sampler.choose(logits)  # [B]
            drafts.append(d)
            all_logits.append(logits)
            ends = [c + n for c, n in reqs]
            if j + 1 < self.k:  # the next step feeds this draft at the next position
                ids, reqs, hidden = d.tolist(), [(e, 1) for e in ends], h
        for r, (c, n) in zip(rids, reqs):
            self._written_end[r] = c + n - 1
        return torch.stack(drafts, dim=1), torch.stack(all_logits, dim=1)

    def after_verify(self, rid: int, old_len: int, num_accepted: int) -> tuple[int, int]:
        """Keep the exact draft positions of request `rid` after `num_accepted` accepts
        (old_len: its committed tokens before the round); the stale positions
        [first, last] of its draft cache (empty when first > last)."""
        exact = 0 if self.uses_target_hidden else min(num_accepted, self.k - 1)
        self.valid[rid] = old_len - self.shift + exact
        return self.valid[rid], self._written_end.get(rid, -1)

    def drop(self, rid: int) -> None:
        self.valid.pop(rid, None)
        self._written_end.pop(rid, None)
