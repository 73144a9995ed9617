"""Sharded KV-cache layout math (docs/architecture.md §5). Pure, vectorised torch; no state.

N = cp (the cache's context-parallel group: pcp * dcp ranks, the DCP group
at pcp = 1), r = rank in it, I = interleave, Bk = per-rank block size. A virtual block
holds Bk * N tokens; each rank's physical page of the same block id holds its Bk.
Positions are request-local token indices. All functions accept tensors of any shape
and broadcast scalars. The layout parameters are keyword-only and always come in one
order, `cp, rank, interleave, block_size` (each function takes the ones it needs),
so two ints can never be swapped silently at a call site.
"""

from __future__ import annotations

import torch


def token_owner(pos: torch.Tensor, *, cp: int, interleave: int, block_size: int) -> torch.Tensor:
    """Rank of the cp group that stores request-local position `pos`."""
    off = pos % (block_size * cp)
    return (off // interleave) % cp


def local_offset(pos: torch.Tensor, *, cp: int, interleave: int, block_size: int) -> torch.Tensor:
    """Offset of `pos` inside its owner's physical page (0 .. block_size-1)."""
    off = pos % (block_size * cp)
    return (off // (cp * interleave)) * interleave + pos % interleave


def local_len(length: torch.Tensor, *, cp: int, rank: int | torch.Tensor, interleave: int) -> torch.Tensor:
    """Tokens of a prefix of `length` tokens stored on `rank`.

    Also the local index of position `length` when `rank` owns it, since local
    slots pack with no holes.
    """
    base = (length // (cp * interleave)) * interleave
    return base + (length - base * cp - rank * interleave).clamp(0, interleave)


def local_slot_mapping(slot_mapping: torch.Tensor, *, cp: int, rank: int, interleave: int,
                       block_size: int) -> torch.Tensor:
    """Global slots (virtual blocks of Bk*N) -> this rank's physical slots; -1 elsewhere.

    Works on the slot mapping alone: virtual blocks start at multiples of Bk*N, so
    the offset inside the virtual block equals the request-local position modulo Bk*N.
    """
    vbs = block_size * cp
    vb = torch.div(slot_mapping, vbs, rounding_mode="floor")
    off = slot_mapping - vb * vbs
    owner = (off // interleave) % cp
    local = vb * block_size + (off // (cp * interleave)) * interleave + off % interleave
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
                      cp: int, rank: int, interleave: int) -> torch.Tensor:
    """Local keys each token attends on `rank`: local_len(r, pos+1), 0 for padding.

    Per query, not per request: with several query tokens per request the local
    count is not `local_len(final) - k` when tokens of one request land on other ranks.
    """
    pos, _ = token_positions(query_start_loc, seq_lens, num_tokens)
    return local_len(pos + 1, cp=cp, rank=rank, interleave=interleave).to(torch.int32)


def local_context_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, *,
                       cp: int, rank: int, interleave: int) -> torch.Tensor:
    """Local keys of each token's cached context (before this step's tokens). int32 [T]."""
    _, req = token_positions(query_start_loc, seq_lens, num_tokens)
    q_len = query_start_loc[1:] - query_start_loc[:-1]
    ctx = (seq_lens - q_len)[req.clamp(min=0).long()]
    ctx = torch.where(req >= 0, ctx, torch.zeros_like(ctx))
    return local_len(ctx, cp=cp, rank=rank, interleave=interleave).to(torch.int32)


def global_to_local_indices(indices: torch.Tensor, *, cp: int, rank: int, interleave: int,
                            block_size: int) -> torch.Tensor:
    """Request-local global positions [..., K] (-1 padded) -> this rank's local indices.

    Entries owned by other ranks are dropped; kept entries are compacted to the front
    in their original order (stable) and the tail is -1.
    """
    valid = indices >= 0
    owned = valid & (token_owner(indices.clamp(min=0), cp=cp, interleave=interleave, block_size=block_size) == rank)
    local = local_len(indices.clamp(min=0), cp=cp, rank=rank, interleave=interleave)
    # Stable compaction: sort by "not owned" with a stable sort keeps original order.
    order = torch.sort((~owned).to(torch.int8), dim=-1, stable=True).indices
    local = torch.gather(torch.where(owned, local, torch.full_like(local, -1)), -1, order)
    return local.to(indices.dtype)


# --------------------------------------------------------------------------- DSA-CP token shards
#
# DSA-CP (docs/dsa_cp.md) shards the *queries* of the indexer and of sparse attention
# by tokens over the TP group: the step's T tokens are padded to T_pad = tp * rows
# (rows = ceil(T / tp)) and rank r owns the contiguous rows [r * rows, (r + 1) * rows).
# Rows at or past query_start_loc[-1] (the step's own padding and the shard padding)
# are padding rows. Keyword-only parameters in one order: `tp, rank`.


def token_shard_rows(num_tokens: int, *, tp: int) -> int:
    """Rows per rank: ceil(T / tp) (T_pad = tp * rows; 0 when T is 0)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    return -(-num_tokens // tp)


def shard_row_metadata(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, rows: int, *, tp: int,
                       rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request index, causal kv length) of this rank's `rows` rows, from the global metadata.

    Row i is the global token t = rank * rows + i. Its request is found from the
    global query_start_loc (-1 for padding rows) and its kv length is its
    single-device causal length pos + 1, so a row sees exactly what the token sees
    on one device. Padding rows get (-1, 0); lengths are clamped at 0 so that a
    malformed (graph-padded) batch can never produce a negative length. int32 [rows] each.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside the TP group of {tp}")
    qsl = query_start_loc
    t = rank * rows + torch.arange(rows, device=qsl.device, dtype=qsl.dtype)  # [rows] global token ids
    req = torch.searchsorted(qsl[1:].contiguous(), t, right=True)
    real = t < qsl[-1]
    safe = torch.where(real, req, torch.zeros_like(req)).long()
    q_len = qsl[1:] - qsl[:-1]  # [B]
    pos = (seq_lens - q_len)[safe] + (t - qsl[safe])  # context + offset in the request's new tokens
    kv = torch.where(real, (pos + 1).clamp(min=0), torch.zeros_like(pos))
    req = torch.where(real, req, torch.full_like(req, -1))
    return req.to(torch.int32), kv.to(torch.int32)


def shard_request_lens(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, rows: int, *, tp: int,
                       rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same shard per request (the TND layout the NPU kernels take): (local query
    count [B], local causal key length [B]) int32.

    Request b's new tokens [qs, qe) meet the shard [start, start + rows) in
    [max(qs, start), min(qe, start + rows)); n = that count, clamped at 0. Its last
    local row sits qe - le tokens before the request's last token, so its key length
    is seq_len - (qe - le), clamped at 0, and 0 when n is 0. With a bottom-right causal
    mask, local row j of the request then sees k - (n - 1 - j) keys, which equals
    `shard_row_metadata`'s kv length of that row.
    """
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} outside the TP group of {tp}")
    start, end = rank * rows, (rank + 1) * rows
    qs, qe = query_start_loc[:-1], query_start_loc[1:]
    ls, le = qs.clamp(min=start), qe.clamp(max=end)
    n = (le - ls).clamp(min=0)
    k = torch.where(n > 0, (seq_lens - (qe - le)).clamp(min=0), torch.zeros_like(seq_lens))
    return n.to(torch.int32), k.to(torch.int32)
