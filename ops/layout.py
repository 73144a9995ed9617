"""DCP KV-cache layout math (docs/architecture.md §5). Pure, vectorised torch; no state.

N = dcp size, r = DCP rank, I = interleave, Bk = per-rank block size. A virtual block
holds Bk * N tokens; each rank's physical page of the same block id holds its Bk.
Positions are request-local token indices. All functions accept tensors of any shape
and broadcast scalars. The layout parameters are keyword-only and always come in one
order, `dcp, rank, interleave, block_size` (each function takes the ones it needs),
so two ints can never be swapped silently at a call site.
"""

from __future__ import annotations

import torch


def token_owner(pos: torch.Tensor, *, dcp: int, interleave: int, block_size: int) -> torch.Tensor:
    """DCP rank that stores request-local position `pos`."""
    off = pos % (block_size * dcp)
    return (off // interleave) % dcp


def local_offset(pos: torch.Tensor, *, dcp: int, interleave: int, block_size: int) -> torch.Tensor:
    """Offset of `pos` inside its owner's physical page (0 .. block_size-1)."""
    off = pos % (block_size * dcp)
    return (off // (dcp * interleave)) * interleave + pos % interleave


def local_len(length: torch.Tensor, *, dcp: int, rank: int | torch.Tensor, interleave: int) -> torch.Tensor:
    """Tokens of a prefix of `length` tokens stored on `rank`.

    Also the local index of position `length` when `rank` owns it, since local
    slots pack with no holes.
    """
    base = (length // (dcp * interleave)) * interleave
    return base + (length - base * dcp - rank * interleave).clamp(0, interleave)


def local_slot_mapping(slot_mapping: torch.Tensor, *, dcp: int, rank: int, interleave: int,
                       block_size: int) -> torch.Tensor:
    """Global slots (virtual blocks of Bk*N) -> this rank's physical slots; -1 elsewhere.

    Works on the slot mapping alone: virtual blocks start at multiples of Bk*N, so
    the offset inside the virtual block equals the request-local position modulo Bk*N.
    """
    vbs = block_size * dcp
    vb = torch.div(slot_mapping, vbs, rounding_mode="floor")
    off = slot_mapping - vb * vbs
    owner = (off // interleave) % dcp
    local = vb * block_size + (off // (dcp * interleave)) * interleave + off % interleave
    keep = (slot_mapping >= 0) & (owner == rank)
    return torch.where(keep, local, torch.full_like(local, -1))


def request_index(query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Request of every flattened token, -1 for padding tokens past query_start_loc[-1]."""
    t = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    req = torch.searchsorted(query_start_loc[1:].contiguous(), t, right=True)
    return torch.where(t < query_start_loc[-1], req, torch.full_like(req, -1))


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(request-local position, request index) of every token; padding gets (-1, -1).

    The new tokens of request b are the last (qsl[b+1]-qsl[b]) of its seq_lens[b].
    """
    req = request_index(query_start_loc, num_tokens)  # [T]
    safe = req.clamp(min=0).long()
    q_len = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    t = torch.arange(num_tokens, device=query_start_loc.device, dtype=query_start_loc.dtype)
    ctx = (seq_lens - q_len)[safe]
    pos = ctx + (t - query_start_loc[safe])
    pos = torch.where(req >= 0, pos, torch.full_like(pos, -1))
    return pos, req


def causal_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Keys each token attends on one device: pos + 1, 0 for padding. int32 [T]."""
    pos, _ = token_positions(query_start_loc, seq_lens, num_tokens)
    return (pos + 1).to(torch.int32)


def local_causal_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, *,
                      dcp: int, rank: int, interleave: int) -> torch.Tensor:
    """Local keys each token attends on `rank`: local_len(r, pos+1), 0 for padding.

    Per query, not per request: with several query tokens per request the local
    count is not `local_len(final) - k` when tokens of one request land on other ranks.
    """
    pos, _ = token_positions(query_start_loc, seq_lens, num_tokens)
    return local_len(pos + 1, dcp=dcp, rank=rank, interleave=interleave).to(torch.int32)


def local_context_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, *,
                       dcp: int, rank: int, interleave: int) -> torch.Tensor:
    """Local keys of each token's cached context (before this step's tokens). int32 [T]."""
    _, req = token_positions(query_start_loc, seq_lens, num_tokens)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    ctx = (seq_lens - q_len)[req.clamp(min=0).long()]
    ctx = torch.where(req >= 0, ctx, torch.zeros_like(ctx))
    return local_len(ctx, dcp=dcp, rank=rank, interleave=interleave).to(torch.int32)


def global_to_local_indices(indices: torch.Tensor, *, dcp: int, rank: int, interleave: int,
                            block_size: int) -> torch.Tensor:
    """Request-local global positions [..., K] (-1 padded) -> this rank's local indices.

    Entries owned by other ranks are dropped; kept entries are compacted to the front
    in their original order (stable) and the tail is -1.
    """
    valid = indices >= 0
    owned = valid & (token_owner(indices.clamp(min=0), dcp=dcp, interleave=interleave, block_size=block_size) == rank)
    local = local_len(indices.clamp(min=0), dcp=dcp, rank=rank, interleave=interleave)
    # Stable compaction: sort by "not owned" with a stable sort keeps original order.
    order = torch.sort((~owned).to(torch.int8), dim=-1, stable=True).indices
    local = torch.gather(torch.where(owned, local, torch.full_like(local, -1)), -1, order)
    return local.to(indices.dtype)
