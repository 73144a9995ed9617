"""One sampler for every rank: temperature, top-k / top-p, a seeded generator, the result shared.

Every rank of a TP / DCP / PCP world runs the same step and must feed the same next
tokens, or their metadata (and then their collectives) diverge. Each rank keeps an
identically seeded generator and draws alike, and the drawn tokens are then
broadcast from global rank 0 (`share`), so even logits that differ in the last bit
between ranks cannot split the world. Greedy (temperature 0) is argmax.

The values are checked and the logits filtered by `cp_compile.base.sampling` (the
front ends' `SamplingParams` rules and `filter_logits`, HF's order: temperature,
top-k, top-p), so speculative and plain decoding sample from the same distribution.
With speculation both the draft's and the target's logits are filtered by the same
rule; speculative sampling over the filtered q and p then keeps the filtered target
distribution (tests/spec_decode/test_acceptance.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from cp_compile.base.sampling import SamplingParams, filter_logits


def share(t: torch.Tensor) -> torch.Tensor:
    """Global rank 0's `t` on every rank (in place); a no-op without a world."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, src=0)
    return t


@dataclass
class Sampler:
    """temperature 0: greedy; > 0: softmax of the logits filtered by temperature, top_k
    (-1 / 0 off) and top_p (1 off), drawn with a generator seeded by `seed` (the same
    on every rank). Bad values raise `cp_compile.base.sampling.SamplingError` naming the field."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = -1
    top_p: float = 1.0
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)
        self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k, top-p."""
        return filter_logits(logits, self.temperature, self.top_k, self.top_p).softmax(dim=-1)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> [B] int64 tokens, the same on every rank."""
        if self.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.multinomial(self.probs(logits).cpu(), 1, generator=self.generator)[:, 0]
        return share(tokens.to(torch.int64).cpu().contiguous())
