"""PCP (prefill context parallel) token split and KV layout math. Pure torch; no state.

Token split (head-tail load balancing). The new tokens of request b (n of them) are
cut into 2*pcp contiguous chunks whose sizes differ by at most one (chunk c starts
at floor(c*n / (2*pcp))); PCP rank r takes chunk r and chunk 2*pcp-1-r. Causal work
grows with the position, so a head chunk paired with the mirrored tail chunk gives
every rank about the same attention work. Short requests (n < 2*pcp) leave the low
chunks empty: their tokens land in the high chunks, so no token is lost or doubled.
Padding tokens (at or past query_start_loc[-1]) belong to no rank: on one device
they produce zeros, and whoever puts the outputs back in global order fills zeros.

KV layout. The cached context is sharded over the whole context-parallel world of
N = pcp * dcp ranks with the DCP rule of docs/architecture.md §5 (`ops/core/layout.py`,
called with dcp=N, rank=cp rank); the context-parallel rank of (pcp_rank, dcp_rank)
is `pcp_rank * dcp + dcp_rank`. Why that order: world ranks are pcp-major
(rank = pcp_rank * tp + tp_rank, `parallel_state.py`) and DCP ranks are consecutive
inside a TP group, so the cp rank is the rank's index in the ascending list of the
pcp*dcp global ranks that share its KV heads: a process group over them (the DCP
decode group at N = pcp*dcp) has group rank == cp rank, and a DCP decode with
`DCPContext(group=<the cp group: N ranks, group rank = cp rank>)` reads the shards the PCP prefill wrote, in place.

Keyword-only parameters, in the order of `ops/core/layout.py` with `pcp` first:
`pcp, dcp, rank, interleave, block_size` (each function takes the ones it needs).
"""

from __future__ import annotations

import torch

from cp_compile.ops.core.layout import request_index


def cp_size(*, pcp: int, dcp: int) -> int:
    """Ranks the KV cache is sharded over under PCP x DCP."""
    return pcp * dcp


def cp_rank(*, pcp_rank: int, dcp: int, dcp_rank: int) -> int:
    """Context-parallel rank of (pcp_rank, dcp_rank): the owner index of §5 at N = pcp*dcp."""
    return pcp_rank * dcp + dcp_rank


def pcp_token_rank(query_start_loc: torch.Tensor, num_tokens: int, *, pcp: int) -> torch.Tensor:
    """PCP rank of every flattened token (head-tail split), -1 for padding. int64 [T]."""
    req = request_index(query_start_loc, num_tokens).long()  # [T], -1 padding
    safe = req.clamp(min=0)
    qsl = query_start_loc.long()
    n = (qsl[1:] - qsl[:-1])[safe]  # [T] new tokens of the token's request
    t = torch.arange(num_tokens, device=query_start_loc.device, dtype=torch.int64)
    j = t - qsl[safe]  # index of the token inside its request's new tokens
    # Largest chunk c with floor(c*n / 2p) <= j, i.e. c = ceil((j+1)*2p / n) - 1.
    chunk = ((j + 1) * 2 * pcp - 1) // n.clamp(min=1)
    rank = torch.where(chunk < pcp, chunk, 2 * pcp - 1 - chunk)
    return torch.where(req >= 0, rank, torch.full_like(rank, -1))


def pcp_token_table(query_start_loc: torch.Tensor, num_tokens: int, *, pcp: int) -> torch.Tensor:
    """[pcp, T_loc] int64: row r = rank r's token indices, ascending, -1 padded.

    T_loc = the largest rank's token count (at least 1), the same on every rank since
    it is read off global metadata: it is the per-rank token dim of a PCP step (equal
    sizes are what the K/V all-gather needs). Host sync: a runtime computes this once
    per step, outside the graph.
    """
    owner = pcp_token_rank(query_start_loc, num_tokens, pcp=pcp)  # [T]
    counts = torch.stack([(owner == r).sum() for r in range(pcp)])
    width = max(int(counts.max()), 1)
    table = torch.full((pcp, width), -1, dtype=torch.int64, device=query_start_loc.device)
    for r in range(pcp):
        idx = torch.nonzero(owner == r).flatten()
        table[r, : idx.numel()] = idx
    return table


def pcp_local_query_start_loc(token_index: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
    """query_start_loc of a rank's tokens: entry b = how many of them precede request b.

    token_index [T_loc] (ascending, -1 padded at the end) -> [B+1] int32. A rank's
    tokens are in global order, so its tokens of request b are contiguous.
    """
    valid = token_index[None, :] >= 0  # [1, T_loc]
    before = token_index[None, :] < query_start_loc.long()[:, None]  # [B+1, T_loc]
    return (valid & before).sum(dim=1).to(torch.int32)


def restore_order(gathered_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Position in a rank-major gather of every global token. int64 [T].

    gathered_index [pcp*T_loc]: the PCP ranks' token tables, concatenated in group rank
    order (-1 padded). Tokens no rank holds (global padding) map to row 0: their slot
    is -1 and no request reads them, so the row is never used.
    """
    # Written for graph passes too (num_tokens may be a traced size): sizes only, no
    # size used as a value. Slot 0 of the buffer collects every -1 (padding) entry.
    g = gathered_index.long()
    rows = torch.ones_like(g).cumsum(0) - 1  # [n]: 0..n-1
    inv = torch.zeros(num_tokens + 1, dtype=torch.int64, device=gathered_index.device)
    inv = inv.scatter(0, g + 1, rows)
    return inv[1:]
