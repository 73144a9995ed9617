"""Which draft tokens the target accepts: greedy matching and speculative sampling.

Both take, per request, k draft tokens and the target's distribution at the k + 1
positions of the verify step (the position before each draft, and one after the
last). Both return, per request, the number `a` of leading drafts accepted and the
a + 1 tokens the step emits: the accepted drafts, then one token of the target's own
(the correction at the first rejection, or the bonus token after k accepts), so
every verify step emits at least one token.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): draft i, drawn from
the draft's distribution q_i, is accepted with probability min(1, p_i(d) / q_i(d));
at the first rejection the token is drawn from norm(max(0, p_i - q_i)); after k
accepts the bonus is drawn from p_k. The emitted tokens are then distributed
exactly as k + 1 draws from the target (tests/spec_decode/test_acceptance.py checks
it on a tiny vocabulary and shows that a wrong rule fails the same check).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Accepted:
    """num_accepted [B] int64: leading drafts accepted (0..k); tokens [B, k + 1] int64:
    the tokens emitted, the first num_accepted + 1 of each row valid, -1 after."""

    num_accepted: torch.Tensor
    tokens: torch.Tensor

    def emitted(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.num_accepted[b]) + 1].tolist()


def _leading(accept: torch.Tensor) -> torch.Tensor:
    """[B, k] bool -> [B] number of leading True entries."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _emit(draft: torch.Tensor, num_accepted: torch.Tensor, last: torch.Tensor) -> Accepted:
    """Accepted drafts, then `last` [B] at index num_accepted, -1 after."""
    B, k = draft.shape
    col = torch.arange(k + 1, device=draft.device)[None, :]  # [1, k + 1]
    padded = torch.cat([draft, draft.new_full((B, 1), -1)], dim=1)  # [B, k + 1]
    tokens = torch.where(col < num_accepted[:, None], padded, torch.full_like(padded, -1))
    tokens = torch.where(col == num_accepted[:, None], last[:, None], tokens)
    return Accepted(num_accepted, tokens)


def _check(draft: torch.Tensor, target: torch.Tensor) -> None:
    if draft.dim() != 2 or target.dim() != 3 or target.shape[:2] != (draft.shape[0], draft.shape[1] + 1):
        raise ValueError(f"draft tokens {tuple(draft.shape)} must be [B, k] and the target's scores "
                         f"{tuple(target.shape)} [B, k + 1, vocab]. Fix: score the last accepted token and the k "
                         f"drafts of every request in one verify step")


def greedy_accept(draft: torch.Tensor, target_logits: torch.Tensor) -> Accepted:
    """draft [B, k] int64, target_logits [B, k + 1, V] -> accept while draft == argmax."""
    _check(draft, target_logits)
    best = target_logits.argmax(dim=-1)  # [B, k + 1]
    a = _leading(draft == best[:, :-1])
    return _emit(draft, a, best.gather(1, a[:, None])[:, 0])


def rejection_sample(draft: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                     generator: torch.Generator | None = None) -> Accepted:
    """draft [B, k] drawn from draft_probs [B, k, V]; target_probs [B, k + 1, V].

    Draws k uniforms and one token per request from `generator` (every rank that
    seeds it alike draws the same).
    """
    _check(draft, target_probs)
    B, k = draft.shape
    p = target_probs.float()
    q = draft_probs.float()
    p_d = p[:, :k].gather(2, draft[..., None])[..., 0]  # [B, k] target prob of each draft
    q_d = q.gather(2, draft[..., None])[..., 0]  # [B, k]
    u = torch.rand(B, k, generator=generator, device=draft.device)
    a = _leading(u * q_d < p_d)  # accept with prob min(1, p/q), without dividing by q
    # The distribution of the token at index a: residual max(0, p - q) after a
    # rejection, the target itself after k accepts (the bonus).
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [B, k + 1, V]
    idx = a[:, None, None].expand(B, 1, p.shape[-1])
    p_a, q_a = p.gather(1, idx)[:, 0], q_pad.gather(1, idx)[:, 0]  # [B, V]
    residual = (p_a - q_a).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    # p == q leaves no residual mass; a rejection then has probability 0, so any
    # distribution serves: use the target's (never divide by 0).
    dist = torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(mass.dtype).tiny), p_a)
    last = torch.multinomial(dist, 1, generator=generator)[:, 0]
    return _emit(draft, a, last)
