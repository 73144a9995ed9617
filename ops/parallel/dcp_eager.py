"""DCP attention compositions that run eagerly only (their shapes depend on the data).

`dcp_mla_chunked_prefill` is the seeds' MLA chunked-prefill variant: it sizes
buffers from the context lengths, so it cannot be traced into a static graph. The
traceable compositions are in `dcp.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cp_compile.ops import layout, reference
from cp_compile.ops.parallel.dcp import DCPContext, localize

_c10d = torch.ops._c10d_functional
_cp = torch.ops.cp


def dcp_mla_chunked_prefill(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                            slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                            scale: float, ctx: DCPContext) -> Tensor:
    """MLA chunked prefill the seeds' way (eager only: its shapes depend on the data).

    Instead of gathering queries, every rank all-gathers the batch's cached context
    latent (each rank packs its local tokens per request, padded to rank 0's count,
    which is the largest), restores request-contiguous order, and its own heads
    attend the whole context; the step's own tokens are attended causally from the
    new latents, and the two parts are merged by LSE.
    """
    T = q_nope.shape[0]
    L = q_nope.shape[-1]
    local = localize(ctx, slot_mapping, query_start_loc, seq_lens)
    latent_new = torch.cat([kv_c, k_pe], dim=-1)  # [T, L+R]
    _cp.cache_write.default(latent_new, kv_cache, local.slot_mapping)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    ctx_lens = seq_lens.long() - q_lens  # [B]
    pad = layout.local_len(ctx_lens, dcp=ctx.dcp, rank=0, interleave=ctx.interleave)  # rank 0 holds the most
    mine = layout.local_len(ctx_lens, dcp=ctx.dcp, rank=ctx.rank, interleave=ctx.interleave)
    packed = kv_cache.new_zeros(int(pad.sum()), kv_cache.shape[-1])
    starts = torch.cumsum(pad, 0) - pad
    for b in range(ctx_lens.shape[0]):
        n = int(mine[b])
        if n:
            packed[int(starts[b]): int(starts[b]) + n] = reference.gather_request_pages(kv_cache, block_table[b], n)
    gathered = _c10d.wait_tensor.default(
        _c10d.all_gather_into_tensor.default(packed, ctx.dcp, ctx.group_name)).view(ctx.dcp, -1, packed.shape[-1])
    # Restore order: position p of request b sits on rank owner(p) at local index local_len(owner, p).
    full = []
    for b in range(ctx_lens.shape[0]):
        p = torch.arange(int(ctx_lens[b]), device=kv_cache.device)
        owner = layout.token_owner(p, dcp=ctx.dcp, interleave=ctx.interleave, block_size=ctx.block_size)
        j = layout.local_len(p, dcp=ctx.dcp, rank=owner, interleave=ctx.interleave)  # packed local index on the owner
        full.append(gathered[owner, starts[b] + j])
    context = torch.cat(full) if full else kv_cache.new_zeros(0, kv_cache.shape[-1])  # [sum ctx, L+R]
    # The restored context as a paged cache of block size 1: table row b = its token indices.
    width = max(int(ctx_lens.max()) if ctx_lens.numel() else 0, 1)
    ctx_starts = torch.cumsum(ctx_lens, 0) - ctx_lens
    table = (ctx_starts[:, None] + torch.arange(width, device=kv_cache.device)).clamp(max=max(context.shape[0] - 1, 0))
    req = layout.request_index(query_start_loc, T)
    kv_lens = torch.where(req >= 0, ctx_lens[req.clamp(min=0)], torch.zeros_like(req, dtype=torch.int64))
    if context.shape[0] == 0:
        context = kv_cache.new_zeros(1, kv_cache.shape[-1])
    q = torch.cat([q_nope, q_pe], dim=-1)
    old = _cp.paged_attention_lse.default(q, context[:, None, None], context[:, None, None, :L], table,
                                          query_start_loc, kv_lens.to(torch.int32), scale)
    new = _cp.varlen_causal_attention_lse.default(q, latent_new[:, None], kv_c[:, None], query_start_loc, scale)
    merged = _cp.lse_combine.default(torch.stack([old[0], new[0]]), torch.stack([old[1], new[1]]))
    return merged[0].to(q_nope.dtype)
