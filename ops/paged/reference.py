"""Torch reference implementations shared by the custom ops (CPU path and test oracle).

Conventions (docs/architecture.md §4): tokens are flattened, `query_start_loc[B+1]`,
`seq_lens[B]`, `block_table[B, nb]` (block ids; only entries covering a request's
length are read), `slot_mapping[T]` (-1 = skip). A paged cache is
`[num_blocks, block_size, ...]`; request-local position j of request b lives at page
`block_table[b, j // block_size]`, offset `j % block_size`.
"""

from __future__ import annotations

import torch

from cp_compile.errors import MetadataError
from cp_compile.ops.layout import request_index
from cp_compile.ops.sharded_cache import SINGLE_DEVICE_OP_RUNS, refuse_sharded


def check_paged_step(caches: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, op: str = "") -> None:
    """Refuse, before a single-device op writes anything, metadata that would make it
    fail half-way (one cache written, the next not; or written, then an IndexError
    while reading) or write the wrong slot. Cheap: dtypes, shapes and three ranges,
    one host sync. The full semantic check (slots match positions, seq_lens cover the
    new tokens, ...) is `cp_compile.metadata.validate_metadata`, run once per step
    by the runtime and model entry points. A DCP / PCP-sharded cache is refused
    first (`sharded_cache`; `op` names the op in the message)."""
    refuse_sharded(((f"the cache of {op or 'a single-device attention op'}", c) for c in caches),
                   SINGLE_DEVICE_OP_RUNS)
    for name, t in (("slot_mapping", slot_mapping), ("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise MetadataError(name, f"dtype {t.dtype} is not an integer index dtype",
                                f"build {name} as torch.int32 or torch.int64 (floats lose slots past 2**24)",
                                value=t.dtype)
    nb_cache, bs = caches[0].shape[0], caches[0].shape[1]
    B = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != B or query_start_loc.shape[0] != B + 1:
        raise MetadataError("block_table", f"shape {tuple(block_table.shape)} with query_start_loc "
                            f"{tuple(query_start_loc.shape)} does not fit seq_lens [B = {B}]",
                            "pass block_table [B, nb], query_start_loc [B+1], seq_lens [B]",
                            value=tuple(block_table.shape))
    width = block_table.shape[1]
    seq = seq_lens.long()
    need = (seq.clamp(min=0) + bs - 1) // bs  # [B] blocks read per request
    used = torch.arange(width, device=block_table.device)[None, :] < need[:, None]
    bt = block_table.long()
    bad_block = used & ((bt < 0) | (bt >= nb_cache))
    slots = slot_mapping.long()
    bad_slot = (slots < -1) | (slots >= nb_cache * bs)
    flags = torch.stack([(need > width).any(), bad_block.any(), bad_slot.any()]).tolist()
    if flags[0]:
        b = int(torch.nonzero(need > width)[0, 0])
        raise MetadataError("block_table", f"has {width} columns but seq_lens = {int(seq[b])} needs {int(need[b])} "
                            f"blocks of {bs} tokens", "widen the block table (max_blocks_per_req) or shorten the "
                            "request", request=b, value=width)
    if flags[1]:
        b, j = divmod(int(torch.nonzero(bad_block.flatten())[0, 0]), width)
        raise MetadataError("block_table", f"block_table[{b}, {j}] = {int(bt[b, j])} is outside the cache's blocks "
                            f"[0, {nb_cache})", "use block ids from a BlockAllocator sized to this cache",
                            request=b, value=int(bt[b, j]))
    if flags[2]:
        i = int(torch.nonzero(bad_slot)[0, 0])
        raise MetadataError("slot_mapping", f"slot_mapping[{i}] = {int(slots[i])} is outside the cache's slots "
                            f"[0, {nb_cache * bs}) and is not -1 (padding)",
                            "slots are block_id * block_size + offset for block ids of this cache; -1 skips",
                            value=int(slots[i]))


def write_cache(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """cache[slot] = new[t] for every token with slot >= 0 (in place)."""
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, ...]
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].long()
    flat.index_copy_(0, idx, new[: slot_mapping.shape[0]][keep].to(cache.dtype))


def gather_request_pages(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one request from a paged cache -> [length, ...]."""
    bs = cache.shape[1]
    nb = (length + bs - 1) // bs
    pages = cache[block_table_row[:nb].long()]  # [nb, bs, ...]
    return pages.reshape(nb * bs, *cache.shape[2:])[:length]


def paged_attention_with_lse(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, Dv]
    block_table: torch.Tensor,  # [B, nb]
    query_start_loc: torch.Tensor,  # [B+1]
    kv_lens: torch.Tensor,  # [T]: token t attends positions 0..kv_lens[t]-1 of its request
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over a prefix of its request's paged keys.

    Returns out [T, Hq, Dv] in q's dtype and lse [T, Hq] in fp32 (natural log).
    A query with no keys (kv_lens 0, or a padding token) gets out 0 and lse -inf.
    Query head h reads KV head h // (Hq // Hkv). Computed in fp32.
    """
    T, Hq, _ = q.shape
    Hkv, Dv = v_cache.shape[2], v_cache.shape[3]
    group = Hq // Hkv
    out = torch.zeros(T, Hq, Dv, dtype=torch.float32, device=q.device)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    req = request_index(query_start_loc, T)
    B = query_start_loc.shape[0] - 1
    kv_lens = kv_lens.to(torch.int64)
    for b in range(B):
        toks = torch.nonzero((req == b) & (kv_lens > 0)).flatten()
        if toks.numel() == 0:
            continue
        n = int(kv_lens[toks].max())
        k = gather_request_pages(k_cache, block_table[b], n).float()  # [n, Hkv, D]
        v = gather_request_pages(v_cache, block_table[b], n).float()  # [n, Hkv, Dv]
        # Query head h = kv * group + j reads KV head kv: group the query heads
        # instead of repeating K/V per head (no H-fold copy of the keys).
        qb = q[toks].float().unflatten(1, (Hkv, group))  # [t, Hkv, g, D]
        s = torch.einsum("tkgd,nkd->kgtn", qb, k) * scale  # [Hkv, g, t, n]
        mask = torch.arange(n, device=q.device)[None, :] < kv_lens[toks][:, None]  # [t, n]
        s = s.masked_fill(~mask, float("-inf"))
        l = torch.logsumexp(s, dim=-1)  # [Hkv, g, t]
        p = torch.exp(s - l[..., None])
        out[toks] = torch.einsum("kgtn,nkd->tkgd", p, v).flatten(1, 2)
        lse[toks] = l.flatten(0, 1).transpose(0, 1)
    return out.to(q.dtype), lse


def mla_attention_with_lse(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                           block_table: torch.Tensor, query_start_loc: torch.Tensor, kv_lens: torch.Tensor,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA as MQA over a paged latent cache [NB, BS, L+R]: keys are the cached
    [c; k_pe], values their first L columns (a view). q_nope [T,H,L], q_pe [T,H,R]
    -> out [T,H,L], lse [T,H] fp32, with the semantics of paged_attention_with_lse."""
    L = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, L+R]
    return paged_attention_with_lse(q, kv_cache.unsqueeze(2), kv_cache[..., :L].unsqueeze(2), block_table,
                                    query_start_loc, kv_lens, scale)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over the listed positions of its request's cache.

    Position j of request b is read at page `block_table[b, j // BS]`, offset `j % BS`,
    whatever those positions mean: global positions on one device, or a rank's local
    (compacted) positions under SFA DCP. No causal crop: indices are trusted.
    Returns out [T, H, v_dim] in q's dtype and lse [T, H] fp32; a query with no valid
    index (or a padding token) gets out 0 and lse -inf. Computed in fp32.
    """
    req = request_index(query_start_loc, q.shape[0])  # [T], -1 for padding
    return sparse_attention_rows_with_lse(q, kv_cache, block_table, req, indices, v_dim, scale)


def sparse_attention_rows_with_lse(
    q: torch.Tensor,  # [T, H, Dqk]: any set of query rows (all tokens, or a DSA-CP shard)
    kv_cache: torch.Tensor,  # [NB, BS, Dqk]
    block_table: torch.Tensor,  # [B, nb]
    req: torch.Tensor,  # [T] request of each row, -1 = padding row (out 0, lse -inf)
    indices: torch.Tensor,  # [T, K] request-local positions, -1 = skip
    v_dim: int,
    scale: float,
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
    kv = kv_cache[page, j % bs].float()  # [T, K, Dqk]
    s = torch.einsum("thd,tkd->thk", q.float(), kv) * scale  # [T, H, K]
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    l = torch.logsumexp(s, dim=-1)  # [T, H]; -inf for empty rows
    # exp(s - l) is NaN on empty rows (-inf - -inf); shift those by 0 so p is exactly 0.
    l_safe = torch.where(torch.isfinite(l), l, torch.zeros_like(l))
    p = torch.exp(s - l_safe[..., None])  # [T, H, K]
    out = torch.einsum("thk,tkd->thd", p, kv[..., :v_dim])
    return out.to(q.dtype), l
