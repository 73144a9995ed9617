"""Torch references of the LSE merges (CPU path and test oracle): exact merges of
partial attentions over disjoint key sets, strict about invalid LSEs (decision 47).
"""

from __future__ import annotations

import torch


def merged_lse(lses: torch.Tensor) -> torch.Tensor:
    """LSE of merged partials: lses [N, ...] -> [...] fp32, logsumexp over dim 0.

    -inf (an empty partial) weighs 0, all-empty gives -inf; a NaN or +inf LSE (no
    valid partial's) makes the row NaN. Strict (issue 26, decision 47): never read as empty."""
    lses = lses.float()
    invalid = (torch.isnan(lses) | torch.isposinf(lses)).any(dim=0)
    return torch.where(invalid, torch.full_like(lses[0], float("nan")), torch.logsumexp(lses, dim=0))


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact merge of partial attentions over disjoint key sets.

    outs [N, ..., Dv], lses [N, ...] (fp32) -> [..., Dv] fp32. A partial with lse
    -inf (an empty shard) weighs 0 and its out is not read (it may be garbage);
    when all are empty the result is 0. A NaN (or +inf) LSE is no partial's valid
    result, so it is not read as empty: the row's output is NaN, loud downstream
    (decision 47: reading NaN as empty hid decision 41's kernel bug as finite,
    wrong attention). Independent of the order of the N partials.
    """
    lses = lses.float()
    empty = lses == float("-inf")  # [N, ...]
    m = lses.amax(dim=0)  # [...]; NaN and +inf propagate
    all_empty = m == float("-inf")
    m_safe = torch.where(all_empty, torch.zeros_like(m), m)
    # where, not multiply: an empty shard's out may be garbage (NaN) and must weigh 0.
    w = torch.where(empty, torch.zeros_like(lses), torch.exp(lses - m_safe))  # NaN where m is NaN / +inf
    denom = w.sum(dim=0)  # >= 1 unless all empty (the max partial weighs 1), NaN if poisoned
    num = torch.where(empty[..., None], torch.zeros((), dtype=torch.float32, device=outs.device),
                      outs.float() * w[..., None]).sum(0)
    return torch.where(all_empty[..., None], torch.zeros_like(num), num / denom[..., None])
