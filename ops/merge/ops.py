"""DCP building blocks as custom ops (docs/architecture.md §5).

Each op is small enough for a pass to place on its own: metadata localisation
(once per forward), local cache write, partial attention over the local shard
returning (out, lse), and the two LSE-merge combines. Collectives are *not* inside
these ops: the compositions in `cp_compile.ops.parallel.dcp` issue them as
`_c10d_functional` ops so they stay visible graph nodes.

CPU runs the flash-style kernels of `cpu_attention` for the attention ops (their
torch references stay the oracle) and the references for the rest; CUDA (and NPU when torch_npu is present) run the
Triton kernels of `cp_compile.ops.kernels` (registered in `ops/kernels/registry.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cp_compile.ops import cpu_attention, layout, reference
from cp_compile.ops.kernels import launch, npu_fused
from cp_compile.ops.spec import GE, TRITON_ASCEND, OpDecl


@torch.library.custom_op("cp::dcp_localize_metadata", mutates_args=())
def dcp_localize_metadata(slot_mapping: Tensor, query_start_loc: Tensor, seq_lens: Tensor, cp: int, rank: int,
                          interleave: int, block_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Global metadata -> this rank's view, computed once per forward for all layers.

    Returns (local_slot_mapping [T] int64, local_seq_lens [B] int32,
    local_causal_lens [T] int32, local_context_lens [T] int32). `block_size` is the
    per-rank page size (virtual blocks hold block_size * cp tokens; cp: the cache's
    context-parallel group size, pcp * dcp).
    """
    T = slot_mapping.shape[0]
    lay = dict(cp=cp, rank=rank, interleave=interleave)
    slots = layout.local_slot_mapping(slot_mapping.long(), **lay, block_size=block_size)
    seq = layout.local_len(seq_lens, **lay).to(torch.int32)
    causal = layout.local_causal_lens(query_start_loc, seq_lens, T, **lay)
    ctx = layout.local_context_lens(query_start_loc, seq_lens, T, **lay)
    return slots, seq, causal, ctx


@dcp_localize_metadata.register_fake
def _(slot_mapping, query_start_loc, seq_lens, cp, rank, interleave, block_size):
    T = slot_mapping.shape[0]
    return (slot_mapping.new_empty(T, dtype=torch.int64), seq_lens.new_empty(seq_lens.shape, dtype=torch.int32),
            slot_mapping.new_empty(T, dtype=torch.int32), slot_mapping.new_empty(T, dtype=torch.int32))


@torch.library.custom_op("cp::cache_write", mutates_args=("cache",))
def cache_write(new: Tensor, cache: Tensor, slot_mapping: Tensor) -> None:
    """cache[slot] = new[t] for tokens with slot >= 0; with a local slot mapping this
    stores only this rank's tokens. new [T, ...], cache [NB, BS, ...]."""
    reference.write_cache(cache, new, slot_mapping)


@cache_write.register_fake
def _(new, cache, slot_mapping):
    return None


@torch.library.custom_op("cp::paged_attention_lse", mutates_args=())
def paged_attention_lse(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, query_start_loc: Tensor,
                        kv_lens: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Partial GQA attention over the local shard: token t attends local positions
    0..kv_lens[t]-1 of its request. q [T,Hq,D] (may be a gathered, strided view),
    caches [NB,BS,Hkv,D|Dv] -> out [T,Hq,Dv] (q dtype), lse [T,Hq] fp32 (-inf if empty)."""
    return reference.paged_attention_with_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)


@paged_attention_lse.register_fake
def _(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale):
    T, H = q.shape[0], q.shape[1]
    return q.new_empty(T, H, v_cache.shape[-1]), q.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("cp::mla_partial_attention", mutates_args=())
def mla_partial_attention(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                          query_start_loc: Tensor, kv_lens: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Partial absorbed-MLA attention over the local latent shard.
    q_nope [T,H,L], q_pe [T,H,R], kv_cache [NB,BS,L+R] -> out [T,H,L], lse [T,H] fp32."""
    return reference.mla_attention_with_lse(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale)


@mla_partial_attention.register_fake
def _(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale):
    T, H, L = q_nope.shape
    return q_nope.new_empty(T, H, L), q_nope.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("cp::dcp_sparse_indices", mutates_args=())
def dcp_sparse_indices(topk_indices: Tensor, cp: int, rank: int, interleave: int, block_size: int) -> Tensor:
    """SFA DCP: global top-k positions -> this rank's local positions.

    topk_indices [T, K] int32: request-local global positions from the (replicated)
    indexer, -1 padded. Returns [T, K] in the same dtype: the local position of every
    entry this rank owns, compacted to the front in the original order, -1 after.
    A local position reads this rank's pages like any local cache position.
    """
    return layout.global_to_local_indices(topk_indices, cp=cp, rank=rank, interleave=interleave,
                                          block_size=block_size)


@dcp_sparse_indices.register_fake
def _(topk_indices, cp, rank, interleave, block_size):
    return torch.empty_like(topk_indices)


@torch.library.custom_op("cp::sparse_mla_partial_attention", mutates_args=())
def sparse_mla_partial_attention(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                                 query_start_loc: Tensor, indices: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Partial sparse MLA over the local latent shard: each query attends the listed
    local positions (no causal crop; the indexer applied causality globally).
    q_nope [T,H,L], q_pe [T,H,R], kv_cache [NB,BS,L+R], indices [T,K] (-1 = skip)
    -> out [T,H,L] (q dtype), lse [T,H] fp32 (-inf where the rank holds none of them)."""
    q = torch.cat([q_nope, q_pe], dim=-1)
    return reference.sparse_attention_with_lse(q, kv_cache, block_table, query_start_loc, indices,
                                               q_nope.shape[-1], scale)


@sparse_mla_partial_attention.register_fake
def _(q_nope, q_pe, kv_cache, block_table, query_start_loc, indices, scale):
    T, H = q_nope.shape[0], q_nope.shape[1]
    return q_nope.new_empty(T, H, q_nope.shape[-1]), q_nope.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("cp::lse_rescale", mutates_args=())
def lse_rescale(out: Tensor, lse: Tensor, lse_all: Tensor) -> tuple[Tensor, Tensor]:
    """AG+RS merge, local half: weight this rank's partial by exp(lse - LSE).

    out [T,G,Dv], lse [T,G] fp32 (this rank's partial), lse_all [N*G, T] fp32 (the
    all-gathered head-major partial LSEs of the N ranks). Returns the rescaled
    partial [T,G,Dv] fp32 (summing it over ranks gives the exact result) and the
    merged LSE [T,G]. Empty shards (lse -inf) weigh 0; all-empty rows give 0, never NaN;
    a NaN LSE on any rank makes the row NaN (strict, decision 47).
    """
    T, G = lse.shape
    parts = lse_all.view(-1, G, T).permute(0, 2, 1).float()  # [N, T, G]
    total = reference.merged_lse(parts)  # [T, G]; -inf when every shard is empty, NaN if one is NaN
    mine = lse.float()
    empty = mine == float("-inf")  # own shard empty (so is an all-empty row): weight 0, out not read
    w = torch.where(empty, torch.zeros_like(mine), torch.exp(mine - total))  # NaN / +inf LSEs propagate
    scaled = torch.where(empty[..., None], torch.zeros((), dtype=torch.float32, device=out.device),
                         out.float() * w[..., None])
    return scaled, total


@lse_rescale.register_fake
def _(out, lse, lse_all):
    return out.new_empty(out.shape, dtype=torch.float32), lse.new_empty(lse.shape, dtype=torch.float32)


@torch.library.custom_op("cp::lse_combine", mutates_args=())
def lse_combine(outs: Tensor, lses: Tensor) -> tuple[Tensor, Tensor]:
    """Merge N partials of the same queries: outs [N, ..., Dv], lses [N, ...] ->
    (out [..., Dv] fp32, lse [...] fp32). Used after the all-to-all, and to combine
    the context and new-token parts of chunked prefill. -inf partials weigh 0, NaN
    propagates (`reference.merge_partials`, decision 47)."""
    merged = reference.merge_partials(outs, lses)
    return merged, reference.merged_lse(lses)


@lse_combine.register_fake
def _(outs, lses):
    return outs.new_empty(outs.shape[1:], dtype=torch.float32), lses.new_empty(lses.shape[1:], dtype=torch.float32)


# ----------------------------------------------------------------------------- declarations (ops/spec.py)
# Every piece of every op above: kernels per device, GE converter, profile bucket.
OPS = (
    OpDecl(dcp_localize_metadata, cuda=launch.dcp_localize_metadata, npu=TRITON_ASCEND,
           ge=GE("cache", "FloorDiv", "FloorMod", "SelectV2"), profile="dcp_local"),
    OpDecl(cache_write, cuda=launch.lazy("cache_write_device"), npu=npu_fused._cache_write,
           ge=GE("cache", "ScatterNdUpdate"), profile="attention"),
    OpDecl(paged_attention_lse, cuda=launch.paged_attention_lse, npu=npu_fused._paged_attention_lse,
           ge=GE("attention", "FusedInferAttentionScore"), profile="attention",
           cpu=cpu_attention.paged_attention_lse),
    OpDecl(mla_partial_attention, cuda=launch.mla_partial_attention, npu=npu_fused._mla_partial_attention,
           ge=GE("attention", "FusedInferAttentionScore"), profile="attention", cpu=cpu_attention.mla_attention_lse),
    OpDecl(dcp_sparse_indices, cuda=launch.dcp_sparse_indices, npu=TRITON_ASCEND,
           ge=GE("sparse", "Sort", "GatherElements"), profile="dcp_local"),
    OpDecl(sparse_mla_partial_attention, cuda=launch.lazy("sparse_mla_partial_attention_device"),
           npu=TRITON_ASCEND, ge=GE("sparse", "SparseFlashAttention"), profile="attention"),
    OpDecl(lse_rescale, cuda=launch.lse_rescale, npu=TRITON_ASCEND,
           ge=GE("merge", "ReduceMaxD", "Exp", "Log", "SelectV2"), profile="dcp_local"),
    OpDecl(lse_combine, cuda=launch.lse_combine, npu=npu_fused._lse_combine,
           ge=GE("merge", "AttentionUpdate"), profile="dcp_local"),
)
