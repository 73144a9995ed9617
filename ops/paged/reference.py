"""Torch references of the paged attention ops (CPU path and test oracle).

Conventions (docs/architecture.md §4) and the paged-cache access they share with the
other families: `cp_compile.ops.core.paged_cache`.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core.layout import request_index
from cp_compile.ops.core.paged_cache import gather_request_rows


def paged_attention_with_lse(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, Dv]
    block_table: torch.Tensor,  # [B, nb]
    query_start_loc: torch.Tensor,  # [B+1]
    kv_lens: torch.Tensor,  # [T]: token t attends positions 0..kv_lens[t]-1 of its request
    scale: float,
    k_scale_cache: torch.Tensor | None = None,  # [NB, BS, Hkv] fp32: a quantised k_cache's row scales
    v_scale_cache: torch.Tensor | None = None,  # [NB, BS, Hkv] fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of each query over a prefix of its request's paged keys.
    A quantised (int8 / fp8) cache is dequantised on load with its scales (issue 39).

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
        k = gather_request_rows(k_cache, k_scale_cache, block_table[b], n)  # [n, Hkv, D] fp32
        v = gather_request_rows(v_cache, v_scale_cache, block_table[b], n)  # [n, Hkv, Dv] fp32
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
                           scale: float, kv_scale_cache: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Absorbed MLA as MQA over a paged latent cache [NB, BS, L+R]: keys are the cached
    [c; k_pe], values their first L columns (a view). q_nope [T,H,L], q_pe [T,H,R]
    -> out [T,H,L], lse [T,H] fp32, with the semantics of paged_attention_with_lse.
    A quantised latent has one scale per token (`kv_scale_cache` [NB, BS, 1]) for both parts."""
    L = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, L+R]
    return paged_attention_with_lse(q, kv_cache.unsqueeze(2), kv_cache[..., :L].unsqueeze(2), block_table,
                                    query_start_loc, kv_lens, scale, kv_scale_cache, kv_scale_cache)
