"""Composed DCP attention with the semantics of the single-device ops (DESIGN.md §5).

The compositions are plain Python over custom ops and raw `_c10d_functional`
collectives (each followed by `wait_tensor`), with no data-dependent control flow
and no shape arithmetic. That makes one piece of code serve both uses:
- eager: call with real tensors on an initialised DCP group (the seeds list eager mode);
- compile: the DCP pass calls the same function with FX proxies, which records the
  building blocks and the collectives as graph nodes (passes/dcp_attention.py).

Head layout: collectives work on dim 0, so tensors cross the wire head-major
([heads, T, ...]); gathered heads are in DCP-group rank order, which is the order
the reduce-scatter / all-to-all chunks return them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

import cp_compile.ops.dcp  # noqa: F401  (registers cp::* building blocks)
from cp_compile.ops import layout, reference

_c10d = torch.ops._c10d_functional
_cp = torch.ops.cp


@dataclass(frozen=True)
class DCPContext:
    """Static facts a DCP graph is specialised on (all part of the pass uuid)."""

    dcp: int
    rank: int
    interleave: int
    block_size: int  # per-rank page size
    group_name: str
    merge: Literal["ag_rs", "a2a"] = "ag_rs"

    @classmethod
    def from_state(cls, state) -> "DCPContext":
        cfg = state.cfg
        return cls(dcp=cfg.dcp, rank=state.dcp_rank, interleave=cfg.interleave, block_size=cfg.block_size,
                   group_name=state.dcp_group_name, merge=cfg.dcp_merge)


class LocalMetadata(NamedTuple):
    slot_mapping: Tensor  # [T] int64, -1 for tokens stored on other ranks
    seq_lens: Tensor  # [B] int32
    causal_lens: Tensor  # [T] int32: local keys each query attends
    context_lens: Tensor  # [T] int32: local keys of each query's cached context


def localize(ctx: DCPContext, slot_mapping: Tensor, query_start_loc: Tensor, seq_lens: Tensor) -> LocalMetadata:
    """Once per forward: the metadata every DCP layer of this rank shares."""
    out = _cp.dcp_localize_metadata.default(slot_mapping, query_start_loc, seq_lens, ctx.block_size, ctx.dcp,
                                            ctx.rank, ctx.interleave)
    return LocalMetadata(out[0], out[1], out[2], out[3])


def all_gather_heads(x: Tensor, ctx: DCPContext) -> Tensor:
    """[T, H, ...] on each rank -> [T, N*H, ...], heads in group rank order."""
    g = _c10d.all_gather_into_tensor.default(x.transpose(0, 1).contiguous(), ctx.dcp, ctx.group_name)
    return _c10d.wait_tensor.default(g).transpose(0, 1)


def merge_heads(out: Tensor, lse: Tensor, ctx: DCPContext, heads: int, v_dim: int,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Partials over all gathered heads -> this rank's `heads` heads, exactly merged.

    out [T, N*H, Dv] (`dtype`), lse [T, N*H] fp32 -> (out [T, H, Dv] `dtype`, lse [T, H] fp32).
    Sizes and dtype are passed in (not read off `out`) so that the function also
    traces with FX proxies, which carry no shapes.
    """
    if ctx.merge == "ag_rs":
        # All-gather the LSEs, weight the local partial, reduce-scatter the sum.
        lse_all = _c10d.all_gather_into_tensor.default(lse.transpose(0, 1).contiguous(), ctx.dcp, ctx.group_name)
        lse_all = _c10d.wait_tensor.default(lse_all)  # [N*N*H, T]
        rescaled = _cp.lse_rescale.default(out, lse, lse_all)
        scaled, total = rescaled[0], rescaled[1]
        summed = _c10d.reduce_scatter_tensor.default(scaled.to(dtype).transpose(0, 1).contiguous(), "sum",
                                                     ctx.dcp, ctx.group_name)
        mine = _c10d.wait_tensor.default(summed).transpose(0, 1)  # [T, H, Dv]
        total = total.transpose(0, 1)[ctx.rank * heads:(ctx.rank + 1) * heads]  # this rank's heads
        return mine.contiguous(), total.transpose(0, 1)
    # One all-to-all of [out | lse]; the fp32 LSE rides as raw bytes in out's dtype.
    packed = torch.cat([out, lse.unsqueeze(-1).view(dtype)], dim=-1)  # [T, N*H, Dv + w]
    splits = [heads] * ctx.dcp
    recv = _c10d.all_to_all_single.default(packed.transpose(0, 1).contiguous(), splits, splits, ctx.group_name)
    recv = _c10d.wait_tensor.default(recv)  # [N*H, T, Dv + w]: chunk j = rank j's partial of my heads
    parts = recv.unflatten(0, (ctx.dcp, heads))  # [N, H, T, Dv + w]
    lses = parts[..., v_dim:].contiguous().view(torch.float32).squeeze(-1)  # [N, H, T]
    merged = _cp.lse_combine.default(parts[..., :v_dim], lses)
    merged, total = merged[0], merged[1]
    return merged.to(dtype).transpose(0, 1).contiguous(), total.transpose(0, 1)


def dcp_gqa_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                      block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                      ctx: DCPContext, local: LocalMetadata | None = None) -> Tensor:
    """DCP version of `cp::gqa_paged_attention`: same arguments (global metadata,
    this rank's cache shard), same output [T, Hq, Dv] for this rank's heads.

    Exact for decode, prefill, chunked prefill and mixed batches: every query
    attends its local causal prefix `local_len(r, pos+1)` on every rank.
    """
    if local is None:
        local = localize(ctx, slot_mapping, query_start_loc, seq_lens)
    _cp.cache_write.default(k, k_cache, local.slot_mapping)
    _cp.cache_write.default(v, v_cache, local.slot_mapping)
    q_all = all_gather_heads(q, ctx)  # [T, N*Hq, D]
    part = _cp.paged_attention_lse.default(q_all, k_cache, v_cache, block_table, query_start_loc,
                                           local.causal_lens, scale)
    return merge_heads(part[0], part[1], ctx, q.shape[1], v.shape[-1], q.dtype)[0]


def dcp_mla_attention(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                      slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                      scale: float, ctx: DCPContext, local: LocalMetadata | None = None) -> Tensor:
    """DCP version of `cp::mla_attention` (absorbed MLA): output [T, H, L] for this rank's heads."""
    if local is None:
        local = localize(ctx, slot_mapping, query_start_loc, seq_lens)
    _cp.cache_write.default(torch.cat([kv_c, k_pe], dim=-1), kv_cache, local.slot_mapping)
    part = _cp.mla_partial_attention.default(all_gather_heads(q_nope, ctx), all_gather_heads(q_pe, ctx),
                                             kv_cache, block_table, query_start_loc, local.causal_lens, scale)
    return merge_heads(part[0], part[1], ctx, q_nope.shape[1], q_nope.shape[-1], q_nope.dtype)[0]


def dcp_gqa_chunked_prefill(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                            slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                            scale: float, ctx: DCPContext, local: LocalMetadata | None = None) -> Tensor:
    """GQA chunked prefill the seeds' way: gathered query heads attend each rank's
    shard of the cached *context* only, the partials are merged, then combined with
    causal attention over the step's own tokens (present on every rank, so no
    collective). Each key is counted once: context keys by the first part, new keys
    by the second. Same result as `dcp_gqa_attention`."""
    if local is None:
        local = localize(ctx, slot_mapping, query_start_loc, seq_lens)
    _cp.cache_write.default(k, k_cache, local.slot_mapping)
    _cp.cache_write.default(v, v_cache, local.slot_mapping)
    part = _cp.paged_attention_lse.default(all_gather_heads(q, ctx), k_cache, v_cache, block_table,
                                           query_start_loc, local.context_lens, scale)
    ctx_out, ctx_lse = merge_heads(part[0], part[1], ctx, q.shape[1], v.shape[-1], q.dtype)
    new = _cp.varlen_causal_attention_lse.default(q, k, v, query_start_loc, scale)
    merged = _cp.lse_combine.default(torch.stack([ctx_out, new[0]]), torch.stack([ctx_lse, new[1]]))
    return merged[0].to(q.dtype)


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
    pad = layout.local_len(ctx_lens, ctx.dcp, 0, ctx.interleave)  # rank 0 holds the most
    mine = layout.local_len(ctx_lens, ctx.dcp, ctx.rank, ctx.interleave)
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
        p = torch.arange(int(ctx_lens[b]))
        owner = layout.token_owner(p, ctx.dcp, ctx.interleave, ctx.block_size)
        j = layout.local_len(p, ctx.dcp, owner, ctx.interleave)  # packed local index on the owner
        full.append(gathered[owner, starts[b] + j])
    context = torch.cat(full) if full else kv_cache.new_zeros(0, kv_cache.shape[-1])  # [sum ctx, L+R]
    # The restored context as a paged cache of block size 1: table row b = its token indices.
    width = max(int(ctx_lens.max()) if ctx_lens.numel() else 0, 1)
    ctx_starts = torch.cumsum(ctx_lens, 0) - ctx_lens
    table = (ctx_starts[:, None] + torch.arange(width)).clamp(max=max(context.shape[0] - 1, 0))
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
