"""One sampler for every rank: temperature, a seeded generator, the result shared.

Every rank of a TP / DCP / PCP world runs the same step and must feed the same next
tokens, or their metadata (and then their collectives) diverge. Each rank keeps an
identically seeded generator and draws alike, and the drawn tokens are then
broadcast from global rank 0 (`share`), so even logits that differ in the last bit
between ranks cannot split the world. Greedy (temperature 0) is argmax.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


def share(t: torch.Tensor) -> torch.Tensor:
    """Global rank 0's `t` on every rank (in place); a no-op without a world."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast(t, src=0)
    return t


@dataclass
class Sampler:
    """temperature 0: greedy; > 0: softmax(logits / temperature), drawn with a generator
    seeded by `seed` (the same on every rank)."""

    temperature: float = 0.0
    seed: int = 0
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0 or t == float("inf"):
            raise ValueError(f"temperature={t!r} must be a finite number >= 0. Fix: 0 for greedy decoding, "
                             f"> 0 to sample from softmax(logits / temperature)")
        self.generator = torch.Generator().manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] fp32 probabilities at this temperature."""
        return torch.softmax(logits.float() / self.temperature, dim=-1)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> [B] int64 tokens, the same on every rank."""
        if self.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.multinomial(self.probs(logits).cpu(), 1, generator=self.generator)[:, 0]
        return share(tokens.to(torch.int64).cpu().contiguous())
