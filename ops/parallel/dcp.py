"""DCP attention compositions, traceable (docs/architecture.md, "DCP math").

Each composition has the semantics of one single-device attention op (same
arguments: global metadata, this rank's cache shard; same output for this rank's
heads) and is written as plain Python over `cp::*` custom ops and raw
`_c10d_functional` collectives (each followed by `wait_tensor`), with no
data-dependent control flow and no shape arithmetic. That makes one piece of code
serve both uses:
- eager: call it with real tensors on an initialised DCP group;
- compile: the DCP attention pass (`passes/dcp_attention.py`) calls it with FX
  proxies, which records the building blocks and the collectives as graph nodes.

Compositions receive a `DCPContext`: the narrow view of the compile context
(`cp_compile.passes.context.CompileContext.cp_view()`) holding only what DCP attention is
specialised on. Nothing here reads module-level parallel state.

Query replication (`merge="replicate"`, decision 49): the caller hands in the queries
of every rank of the group (q [T, N*Hq, D], rank-major: what `all_gather_heads` would
have given), so the compositions skip the Q all-gather and the merge is one
all-to-all; in graphs the DCP pass builds those queries by replicating the query
projection (passes/query_replication.py).

Head layout: collectives work on dim 0, so tensors cross the wire head-major
([heads, T, ...]); gathered heads are in DCP-group rank order, which is the order
the reduce-scatter / all-to-all chunks return them in.

"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
from torch import Tensor

import cp_compile.ops  # noqa: F401  (registers the cp::* building blocks)
from cp_compile.base.parallel_layout import Group

_c10d = torch.ops._c10d_functional
_cp = torch.ops.cp


@dataclass(frozen=True)
class DCPContext:
    """Static facts a DCP graph is specialised on (baked into the traced graph).

    group: the layout's group the composition runs over (`Group(size, rank, name)`,
    cp_compile/base/parallel_layout.py; the name addresses the functional collectives).
    For attention over the cache that is the cache's context-parallel group
    (`CompileContext.cp`: the DCP group at pcp = 1, the pcp * dcp ranks at pcp > 1);
    for the head gather inside a PCP prefill it is the DCP group
    (`PCPContext.dcp_group_view`). The rest are the config's cache knobs and the
    merge chosen for this graph.
    """

    group: Group
    interleave: int
    block_size: int  # per-rank page size
    merge: Literal["ag_rs", "a2a", "replicate"] = "ag_rs"

    @property
    def replicated(self) -> bool:
        """Queries arrive replicated (the group's heads on every rank): no Q all-gather."""
        return self.merge == "replicate"


MERGES = ("ag_rs", "a2a", "replicate")


class LocalMetadata(NamedTuple):
    slot_mapping: Tensor  # [T] int64, -1 for tokens stored on other ranks
    seq_lens: Tensor  # [B] int32
    causal_lens: Tensor  # [T] int32: local keys each query attends
    context_lens: Tensor  # [T] int32: local keys of each query's cached context


def localize(ctx: DCPContext, slot_mapping: Tensor, query_start_loc: Tensor, seq_lens: Tensor) -> LocalMetadata:
    """Once per forward: the metadata every DCP layer of this rank shares."""
    out = _cp.dcp_localize_metadata.default(slot_mapping, query_start_loc, seq_lens, ctx.group.size, ctx.group.rank,
                                            ctx.interleave, ctx.block_size)
    return LocalMetadata(out[0], out[1], out[2], out[3])


def dense(x: Tensor) -> Tensor:
    """A contiguous copy. Not `.contiguous()`: on a symbolic token dim its "already
    contiguous?" test guards T != 1 while a pass traces, and a 1-token step after that
    recompiles (issue 19). The compositions copy what a collective or view needs dense."""
    return x.clone(memory_format=torch.contiguous_format)


def all_gather_heads(x: Tensor, ctx: DCPContext) -> Tensor:
    """[T, H, ...] on each rank -> [T, N*H, ...], heads in group rank order."""
    g = _c10d.all_gather_into_tensor.default(dense(x.transpose(0, 1)), ctx.group.size, ctx.group.name)
    return _c10d.wait_tensor.default(g).transpose(0, 1)


def all_gather_heads_fused(q_nope: Tensor, q_pe: Tensor, ctx: DCPContext) -> Tensor:
    """MLA queries: one all-gather of [q_nope | q_pe] ([T, H, L+R] -> [T, N*H, L+R]).

    One collective instead of two per layer: on a shared machine each collective
    costs a fixed latency far above its bytes, and on devices it is one launch less.
    The caller slices the nope and rope parts back out (views, no copy). The two parts are
    concatenated straight into the collective's head-major [H, T, L+R] input (one copy of Q;
    `all_gather_heads` of the token-major cat would copy it twice: the cat, then the dense
    transpose; issue 27).
    """
    both = torch.cat([q_nope.transpose(0, 1), q_pe.transpose(0, 1)], dim=-1)  # [H, T, L+R], contiguous
    g = _c10d.all_gather_into_tensor.default(both, ctx.group.size, ctx.group.name)
    return _c10d.wait_tensor.default(g).transpose(0, 1)


def kv_major_heads(x: Tensor, ranks: int, kv_heads: int) -> Tensor:
    """Gathered heads from rank-major to KV-head-major order, for the single-device op.

    x [T, N*Hq, ...] = [rank 0's Hq | rank 1's Hq | ...], each rank's query head j reading
    its KV head j // (Hq / Hkv). The op maps head h to KV head h // (N*Hq / Hkv), so it
    needs [KV head 0's N*G | KV head 1's N*G | ...] (G = Hq / Hkv): then head h's KV head
    is right for any Hkv. The PCP decode gathers over ranks that hold the same heads
    with several KV heads each (issue 19); at Hkv = 1 (DCP inside TP) it is the identity.
    """
    if kv_heads == 1:
        return x
    # [T, N, Hkv, G, ...] -> [T, Hkv, N, G, ...]
    return dense(x.unflatten(1, (ranks, kv_heads, -1)).transpose(1, 2).flatten(1, 3))


def rank_major_heads(x: Tensor, ranks: int, kv_heads: int) -> Tensor:
    """Inverse of `kv_major_heads` on the op's outputs (out [T, N*Hq, Dv] or lse [T, N*Hq]):
    back to the rank-major chunks the merge hands each rank."""
    if kv_heads == 1:
        return x
    return dense(x.unflatten(1, (kv_heads, ranks, -1)).transpose(1, 2).flatten(1, 3))


def group_queries(q: Tensor, ctx: DCPContext) -> Tensor:
    """The group's query heads [T, N*H, ...] (rank-major): gathered, or as given when replicated."""
    return q if ctx.replicated else all_gather_heads(q, ctx)


def gathered_gqa_partial(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                         query_start_loc: Tensor, kv_lens: Tensor, scale: float, kv_heads: int,
                         ctx: DCPContext, k_scale_cache: Tensor | None = None,
                         v_scale_cache: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Every rank's query heads against this rank's shard: q [T, Hq, D] (replicated:
    [T, N*Hq, D]) -> (out [T, N*Hq, Dv], lse [T, N*Hq]), heads rank-major, each with its
    own KV head."""
    q_all = kv_major_heads(group_queries(q, ctx), ctx.group.size, kv_heads)  # [T, N*Hq, D]
    part = _cp.paged_attention_lse.default(q_all, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale,
                                           k_scale_cache, v_scale_cache)
    return rank_major_heads(part[0], ctx.group.size, kv_heads), rank_major_heads(part[1], ctx.group.size, kv_heads)


def merge_heads(out: Tensor, lse: Tensor, ctx: DCPContext, heads: int,
                dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Partials over all gathered heads -> this rank's `heads` heads, exactly merged.

    out [T, N*H, Dv] (`dtype`), lse [T, N*H] fp32 -> (out [T, H, Dv] `dtype`, lse [T, H] fp32).
    Sizes and dtype are passed in (not read off `out`) so that the function also
    traces with FX proxies, which carry no shapes.
    """
    if ctx.merge not in MERGES:  # "auto" is resolved by the pass (passes/merge_choice.py)
        raise ValueError(f"merge={ctx.merge!r} reached the composition unresolved; the DCP / PCP pass must "
                         "replace 'auto' by the merge it chose ('ag_rs', 'a2a' or 'replicate'). Fix: calling a "
                         "composition outside a compiled graph, set CPConfig(dcp_merge='ag_rs') (or 'a2a', "
                         "'replicate') explicitly")
    if ctx.merge == "ag_rs":
        # All-gather the LSEs, weight the local partial, reduce-scatter the sum.
        lse_all = _c10d.all_gather_into_tensor.default(dense(lse.transpose(0, 1)), ctx.group.size, ctx.group.name)
        lse_all = _c10d.wait_tensor.default(lse_all)  # [N*N*H, T]
        rescaled = _cp.lse_rescale.default(out, lse, lse_all)
        scaled, total = rescaled[0], rescaled[1]
        summed = _c10d.reduce_scatter_tensor.default(dense(scaled.to(dtype).transpose(0, 1)), "sum",
                                                     ctx.group.size, ctx.group.name)
        mine = _c10d.wait_tensor.default(summed).transpose(0, 1)  # [T, H, Dv]
        total = total.transpose(0, 1)[ctx.group.rank * heads:(ctx.group.rank + 1) * heads]  # this rank's heads
        return dense(mine), total.transpose(0, 1)
    # A2A and replicate: one all-to-all of [lse | out]; the fp32 LSE rides as raw bytes in out's dtype (w columns).
    # LSE first, so both halves are cut at the static offset w, and its size-1 dim is dropped by
    # index, not squeeze: Dv may be symbolic (Dynamo's automatic dynamic made a cache's head dim
    # dynamic when two models share one forward, issue 25), and then `parts[..., Dv:]` is a slice
    # of unknown width that `squeeze(-1)` keeps under backed size-oblivious symbols: lse_combine
    # got [N, H, T, 1] LSEs (a shape error at run time, an Inductor size assert at dcp 4).
    w = 4 // dtype.itemsize  # fp32 LSE in `dtype` columns
    packed = torch.cat([lse.unsqueeze(-1).view(dtype), out], dim=-1)  # [T, N*H, w + Dv]
    splits = [heads] * ctx.group.size
    recv = _c10d.all_to_all_single.default(dense(packed.transpose(0, 1)), splits, splits, ctx.group.name)
    recv = _c10d.wait_tensor.default(recv)  # [N*H, T, w + Dv]: chunk j = rank j's partial of my heads
    parts = recv.unflatten(0, (ctx.group.size, heads))  # [N, H, T, w + Dv]
    lses = dense(parts[..., :w]).view(torch.float32)[..., 0]  # [N, H, T]
    merged = _cp.lse_combine.default(parts[..., w:], lses)
    merged, total = merged[0], merged[1]
    return dense(merged.to(dtype).transpose(0, 1)), total.transpose(0, 1)


def write_cache(new: Tensor, cache: Tensor, slot_mapping: Tensor, scale_cache: Tensor | None = None,
                static_scale: Tensor | None = None) -> None:
    """This rank's tokens into its shard: `cp::cache_write`, or `cp::quant_cache_write` for a
    quantised cache (its scales beside the pages, on the owner rank; issue 39), with the
    layer's static scale where a checkpoint gave one (decision 71)."""
    if scale_cache is None:
        _cp.cache_write.default(new, cache, slot_mapping)
    elif static_scale is None:
        _cp.quant_cache_write.default(new, cache, scale_cache, slot_mapping)
    else:
        _cp.quant_cache_write.default(new, cache, scale_cache, slot_mapping, static_scale)


def dcp_gqa_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                      block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                      ctx: DCPContext, local: LocalMetadata | None = None, k_scale_cache: Tensor | None = None,
                      v_scale_cache: Tensor | None = None, k_static_scale: Tensor | None = None,
                      v_static_scale: Tensor | None = None) -> Tensor:
    """DCP version of `cp::gqa_paged_attention`: same arguments (global metadata,
    this rank's cache shard), same output [T, Hq, Dv] for this rank's heads
    (replicated: q [T, N*Hq, D] holds the group's heads, the output this rank's Hq).
    A quantised cache's scales are this rank's shard too (same pages): each token is
    quantised by its owner's write, and read back by its owner only (issue 39).

    Exact for decode, prefill, chunked prefill and mixed batches: every query
    attends its local causal prefix `local_len(r, pos+1)` on every rank.
    """
    return merge_partial(dcp_gqa_partial(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens,
                                         query_start_loc, scale, ctx, local, k_scale_cache, v_scale_cache,
                                         k_static_scale, v_static_scale), ctx)


def dcp_gqa_partial(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                    block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                    ctx: DCPContext, local: LocalMetadata | None = None, k_scale_cache: Tensor | None = None,
                    v_scale_cache: Tensor | None = None, k_static_scale: Tensor | None = None,
                    v_static_scale: Tensor | None = None) -> "Partial":
    """`dcp_gqa_attention` up to the merge: local K/V writes, the group's queries, the partial
    over the local shard (out [T, N*Hq, Dv], lse [T, N*Hq]; the all-reduce fold, issue 37)."""
    if local is None:
        local = localize(ctx, slot_mapping, query_start_loc, seq_lens)
    write_cache(k, k_cache, local.slot_mapping, k_scale_cache, k_static_scale)
    write_cache(v, v_cache, local.slot_mapping, v_scale_cache, v_static_scale)
    out, lse = gathered_gqa_partial(q, k_cache, v_cache, block_table, query_start_loc, local.causal_lens, scale,
                                    k.shape[1], ctx, k_scale_cache, v_scale_cache)  # [T, N*Hq, Dv], [T, N*Hq]
    return Partial(out, lse, own_heads(q, ctx), q.dtype)


def own_heads(q: Tensor, ctx: DCPContext) -> int:
    """This rank's query heads: q's, or 1/N of them when q holds the group's (replicated)."""
    return q.shape[1] // ctx.group.size if ctx.replicated else q.shape[1]


class Partial(NamedTuple):
    """One rank's partial attention over its shard, before the merge: out [T, N*H, Dv]
    (`dtype`, the group's heads rank-major), lse [T, N*H] fp32, `heads` = this rank's H.
    The merge is linear in `out` (`out = sum_r w_r * out_r`), so a per-head linear map of
    `out` commutes with it (project before the merge, passes/project_before_merge.py)."""

    out: Tensor
    lse: Tensor
    heads: int
    dtype: torch.dtype


def merge_partial(part: Partial, ctx: DCPContext) -> Tensor:
    """The merged output [T, H, Dv] of this rank's heads."""
    return merge_heads(part.out, part.lse, ctx, part.heads, part.dtype)[0]


def rescale_partial(part: Partial, ctx: DCPContext) -> Tensor:
    """Each rank's share of the merged output of the group's N*H heads: the partial weighted by
    `w_r = exp(lse_r - LSE)` (`cp::lse_rescale` on the all-gathered LSEs, AG+RS's first half),
    [T, N*H, Dv] in the partial's dtype. Summed over the group's ranks it is the merged output of
    every head of the group; the all-reduce fold (passes/allreduce_fold.py) leaves that sum to the
    TP all-reduce after o_proj, so no output collective runs here, only the LSE all-gather."""
    lse_all = _c10d.all_gather_into_tensor.default(dense(part.lse.transpose(0, 1)), ctx.group.size, ctx.group.name)
    lse_all = _c10d.wait_tensor.default(lse_all)  # [N*N*H, T]
    return _cp.lse_rescale.default(part.out, part.lse, lse_all)[0].to(part.dtype)


def dcp_mla_partial(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                    slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                    scale: float, ctx: DCPContext, local: LocalMetadata | None = None,
                    kv_scale_cache: Tensor | None = None, kv_static_scale: Tensor | None = None) -> Partial:
    """`dcp_mla_attention` up to the merge: local latent write, the group's queries, the
    partial over the local shard (out [T, N*H, L]; a quantised latent: its per-token scales
    sharded with the pages)."""
    if local is None:
        local = localize(ctx, slot_mapping, query_start_loc, seq_lens)
    write_cache(torch.cat([kv_c, k_pe], dim=-1), kv_cache, local.slot_mapping, kv_scale_cache, kv_static_scale)
    heads = own_heads(q_nope, ctx)
    q_nope, q_pe = group_mla_queries(q_nope, q_pe, ctx)  # [T, N*H, L], [T, N*H, R]
    part = _cp.mla_partial_attention.default(q_nope, q_pe, kv_cache, block_table,
                                             query_start_loc, local.causal_lens, scale, kv_scale_cache)
    return Partial(part[0], part[1], heads, q_nope.dtype)


def dcp_mla_attention(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                      slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                      scale: float, ctx: DCPContext, local: LocalMetadata | None = None,
                      kv_scale_cache: Tensor | None = None, kv_static_scale: Tensor | None = None) -> Tensor:
    """DCP version of `cp::mla_attention` (absorbed MLA): output [T, H, L] for this rank's heads."""
    return merge_partial(dcp_mla_partial(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                                         query_start_loc, scale, ctx, local, kv_scale_cache, kv_static_scale), ctx)


def group_mla_queries(q_nope: Tensor, q_pe: Tensor, ctx: DCPContext) -> tuple[Tensor, Tensor]:
    """The group's MLA queries: one fused all-gather, or as given when replicated."""
    if ctx.replicated:
        return q_nope, q_pe
    L = q_nope.shape[-1]
    q_all = all_gather_heads_fused(q_nope, q_pe, ctx)  # [T, N*H, L+R]
    return q_all[..., :L], q_all[..., L:]


def dcp_sfa_partial(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                    slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                    topk_indices: Tensor, scale: float, ctx: DCPContext,
                    local: LocalMetadata | None = None, kv_scale_cache: Tensor | None = None) -> Partial:
    """`dcp_sfa_attention` up to the merge (out [T, N*H, L]). A quantised latent: each token
    quantised by its owner's write (codes and scale on the owner), read back by the owner only."""
    if local is None:
        local = localize(ctx, slot_mapping, query_start_loc, seq_lens)
    write_cache(torch.cat([kv_c, k_pe], dim=-1), kv_cache, local.slot_mapping, kv_scale_cache)
    idx = _cp.dcp_sparse_indices.default(topk_indices, ctx.group.size, ctx.group.rank, ctx.interleave, ctx.block_size)
    heads = own_heads(q_nope, ctx)
    q_nope, q_pe = group_mla_queries(q_nope, q_pe, ctx)  # [T, N*H, L], [T, N*H, R]
    # The scale cache only when there is one: the model-dtype call keeps its 7 arguments, the
    # ones its GE converter (ops/sparse/ge.py, SparseFlashAttention) takes.
    scales = () if kv_scale_cache is None else (kv_scale_cache,)
    part = _cp.sparse_mla_partial_attention.default(q_nope, q_pe, kv_cache, block_table,
                                                    query_start_loc, idx, scale, *scales)
    return Partial(part[0], part[1], heads, q_nope.dtype)


def dcp_sfa_attention(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                      slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                      topk_indices: Tensor, scale: float, ctx: DCPContext,
                      local: LocalMetadata | None = None, kv_scale_cache: Tensor | None = None) -> Tensor:
    """DCP version of `cp::sparse_mla_attention` (SFA DCP with a replicated indexer):
    output [T, H, L] for this rank's heads.

    The indexer ran on a replicated cache, so `topk_indices` are the single-device
    global positions, identical on every rank. Each rank keeps the ones it stores
    (`cp::dcp_sparse_indices`), attends them with every gathered head and no causal
    crop, and the partials are merged by LSE: every selected key is counted once, on
    its owner. Exact for decode, prefill and mixed batches. A quantised latent's scales are
    sharded with its pages (`kv_scale_cache`, the layer's [NB, BS, 1] scale shard; issue 39).
    """
    return merge_partial(dcp_sfa_partial(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                                         query_start_loc, topk_indices, scale, ctx, local, kv_scale_cache), ctx)
