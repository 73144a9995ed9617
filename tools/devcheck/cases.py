"""Paged decode batches at chosen sizes, for the kernel, bandwidth, DCP and prefill steps.

One batch: B requests, one new token each (decode), pages of `block` keys in a shuffled
block table, every slot no request owns poisoned with NaN (a kernel that reads past a
request's keys turns its output NaN, which fails the comparison). `lens` are the
requests' context lengths (a decode token attends kv_len = its request's length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Paged:
    block_table: torch.Tensor  # [B, nb] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    kv_lens: torch.Tensor  # [B] int32 (one decode token per request)
    num_blocks: int
    block: int


def paged_batch(lens: list[int], block: int, device: torch.device, gen: torch.Generator,
                spare_blocks: int = 0) -> Paged:
    B = len(lens)
    nb = max(1, -(-max(lens) // block))
    num_blocks = B * nb + spare_blocks
    bt = torch.randperm(num_blocks, generator=gen, device=gen.device)[:B * nb].view(B, nb).to(torch.int32)
    return Paged(bt.to(device), torch.arange(B + 1, dtype=torch.int32, device=device),
                 torch.tensor(lens, dtype=torch.int32, device=device), num_blocks, block)


def owned_mask(p: Paged) -> torch.Tensor:
    """[num_blocks, block] bool: the slots some request reads."""
    own = torch.zeros(p.num_blocks * p.block, dtype=torch.bool, device=p.block_table.device)
    for b, n in enumerate(p.kv_lens.tolist()):
        pos = torch.arange(n, device=own.device)
        own[p.block_table[b].long()[pos // p.block] * p.block + pos % p.block] = True
    return own.view(p.num_blocks, p.block)


def cache(p: Paged, *tail: int, dtype: torch.dtype, gen: torch.Generator, poison: bool = True) -> torch.Tensor:
    """[num_blocks, block, *tail], NaN in every slot no request reads."""
    c = torch.randn(p.num_blocks, p.block, *tail, generator=gen, device=gen.device).to(
        device=p.block_table.device, dtype=dtype)
    if poison:
        c[~owned_mask(p)] = float("nan")
    return c


def contiguous(c: torch.Tensor, p: Paged, ctx: int) -> torch.Tensor:
    """The first `ctx` keys of every request gathered: [B, ctx, *tail] (for SDPA)."""
    B = p.block_table.shape[0]
    return c[p.block_table.long()].flatten(1, 2)[:, :ctx].reshape(B, ctx, *c.shape[2:])
