"""Torch references of the sparse (DSA) ops (CPU path and test oracle): the lightning
indexer's scores and top-k, and sparse attention over listed cache positions.

Conventions (docs/architecture.md §4): `cp_compile.ops.core.paged_cache`.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core import kv_quant
from cp_compile.ops.core.layout import request_index
from cp_compile.ops.core.paged_cache import gather_request_pages


def lightning_index_scores(q_i: torch.Tensor, k_i: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """I[t, s] = sum_j w[t, j] * relu(q_i[t, j] . k_i[s]); q_i [t,Hi,Di], k_i [s,Di], w [t,Hi] -> [t, s] fp32."""
    dots = torch.einsum("thd,sd->ths", q_i.float(), k_i.float())
    return torch.einsum("th,ths->ts", w.float(), torch.relu(dots))


def lightning_indexer_topk(
    q_i: torch.Tensor,  # [T, Hi, Di]
    index_cache: torch.Tensor,  # [NB, BS, Di]
    w: torch.Tensor,  # [T, Hi]
    block_table: torch.Tensor,  # [B, nb]
    query_start_loc: torch.Tensor,  # [B+1]
    kv_lens: torch.Tensor,  # [T]: token t scores positions 0..kv_lens[t]-1 of its request
    topk: int,
) -> torch.Tensor:
    """Top-k request-local positions by lightning-indexer score -> int32 [T, topk].

    Order: descending score, ties broken by the lower position (a stable sort over
    positions in ascending order), so the result is deterministic and identical on
    every rank that holds the same (replicated) index cache. Rows with fewer than
    `topk` keys are padded with -1; padding tokens (kv_lens 0) are all -1.
    """
    req = request_index(query_start_loc, q_i.shape[0])
    return lightning_indexer_topk_rows(q_i, index_cache, w, block_table, req, kv_lens, topk)


def lightning_indexer_topk_rows(
    q_i: torch.Tensor,  # [T, Hi, Di]: any set of query rows (all tokens, or a DSA-CP shard)
    index_cache: torch.Tensor,  # [NB, BS, Di]
    w: torch.Tensor,  # [T, Hi]
    block_table: torch.Tensor,  # [B, nb]
    req: torch.Tensor,  # [T] request of each row, -1 = padding row
    kv_lens: torch.Tensor,  # [T]: row t scores positions 0..kv_lens[t]-1 of its request
    topk: int,
) -> torch.Tensor:
    """`lightning_indexer_topk` for rows given by their request index -> int32 [T, topk].

    The rows need not be the step's tokens in order: a DSA-CP rank passes its token
    shard with the request and causal length of each row. Same scoring, same stable
    sort, same -1 padding, so a row gets the same top-k as that token on one device.
    """
    T = q_i.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q_i.device)
    B = block_table.shape[0]
    req = req.to(torch.int64)
    kv_lens = kv_lens.to(torch.int64)
    for b in range(B):
        toks = torch.nonzero((req == b) & (kv_lens > 0)).flatten()
        if toks.numel() == 0:
            continue
        n = int(kv_lens[toks].max())
        k = gather_request_pages(index_cache, block_table[b], n)  # [n, Di]
        s = lightning_index_scores(q_i[toks], k, w[toks])  # [t, n] fp32
        pos = torch.arange(n, device=q_i.device)
        valid = pos[None, :] < kv_lens[toks][:, None]  # [t, n] causal
        s = s.masked_fill(~valid, float("-inf"))
        # Stable sort: among equal scores the lower position (earlier column) wins;
        # torch.topk gives no such guarantee.
        idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :topk]  # [t, k']
        # Masked (future) positions sort last; by position, not by score, they become -1.
        idx = torch.where(idx < kv_lens[toks][:, None], idx, torch.full_like(idx, -1))
        out[toks, : idx.shape[1]] = idx.to(torch.int32)
    return out


def sparse_attention_with_lse(
    q: torch.Tensor,  # [T, H, Dqk]
    kv_cache: torch.Tensor,  # [NB, BS, Dqk]: one shared (MQA) key per slot; V = first v_dim columns
    block_table: torch.Tensor,  # [B, nb]
    query_start_loc: torch.Tensor,  # [B+1]
    indices: torch.Tensor,  # [T, K]: positions into the request's paged cache, -1 = skip
    v_dim: int,
    scale: float,
    kv_scale_cache: torch.Tensor | None = None,  # [NB, BS, 1] fp32: a quantised latent's per-token scales
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over the listed positions of its request's cache.

    Position j of request b is read at page `block_table[b, j // BS]`, offset `j % BS`,
    whatever those positions mean: global positions on one device, or a rank's local
    (compacted) positions under SFA DCP. No causal crop: indices are trusted.
    Returns out [T, H, v_dim] in q's dtype and lse [T, H] fp32; a query with no valid
    index (or a padding token) gets out 0 and lse -inf. Computed in fp32. A quantised
    (int8 / fp8) latent is dequantised on load, `code * scale` in fp32 (issue 39).
    """
    req = request_index(query_start_loc, q.shape[0])  # [T], -1 for padding
    return sparse_attention_rows_with_lse(q, kv_cache, block_table, req, indices, v_dim, scale, kv_scale_cache)


def sparse_attention_rows_with_lse(
    q: torch.Tensor,  # [T, H, Dqk]: any set of query rows (all tokens, or a DSA-CP shard)
    kv_cache: torch.Tensor,  # [NB, BS, Dqk]
    block_table: torch.Tensor,  # [B, nb]
    req: torch.Tensor,  # [T] request of each row, -1 = padding row (out 0, lse -inf)
    indices: torch.Tensor,  # [T, K] request-local positions, -1 = skip
    v_dim: int,
    scale: float,
    kv_scale_cache: torch.Tensor | None = None,  # [NB, BS, 1] fp32 (quantised latent)
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention_with_lse` for rows given by their request index (see there)."""
    T, H, _ = q.shape
    out = torch.zeros(T, H, v_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    if T == 0 or indices.shape[1] == 0 or block_table.shape[0] == 0:
        return out.to(q.dtype), lse
    bs = kv_cache.shape[1]
    req = req.long()
    idx = indices.long()  # [T, K]
    valid = (idx >= 0) & (req[:, None] >= 0)  # [T, K]
    j = torch.where(valid, idx, torch.zeros_like(idx))
    page = block_table.long()[req.clamp(min=0)[:, None], j // bs]  # [T, K]
    # Skipped entries read page 0 (always a real page), never an unused table entry.
    page = torch.where(valid, page, torch.zeros_like(page))
    if kv_scale_cache is None:
        kv = kv_cache[page, j % bs].float()  # [T, K, Dqk]
    else:
        # Codes gathered as bytes (CPU indexing has no fp8 kernel), then `code * scale` in fp32.
        codes = kv_quant.bytes_view(kv_cache)[page, j % bs].view(kv_cache.dtype)  # [T, K, Dqk]
        kv = kv_quant.dequantize(codes, kv_quant.scale_view(kv_cache, kv_scale_cache)[page, j % bs])
    s = torch.einsum("thd,tkd->thk", q.float(), kv) * scale  # [T, H, K]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    l = torch.logsumexp(s, dim=-1)  # [T, H]; -inf for empty rows
    # exp(s - l) is NaN on empty rows (-inf - -inf); shift those by 0 so p is exactly 0.
    l_safe = torch.where(torch.isfinite(l), l, torch.zeros_like(l))
    p = torch.exp(s - l_safe[..., None])  # [T, H, K]
    out = torch.einsum("thk,tkd->thd", p, kv[..., :v_dim])
    return out.to(q.dtype), l
