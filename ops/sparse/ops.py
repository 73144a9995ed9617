"""The sparse (DSA) attention ops (docs/architecture.md §4, §5): the single-device
lightning indexer and sparse MLA (SFA) that models call, and the SFA DCP building
blocks over a rank's latent shard. The DSA-CP token-shard ops are in `dsa_cp.py`.

Custom ops in the `cp` namespace like the paged family's (`paged/ops.py`: metadata
conventions, `mutates_args`, fakes); the body is the torch reference (`reference.py`),
the device kernels are Triton (`launch.py`). Padding tokens produce zeros (attention)
or -1 rows (indexer). Callers use `torch.ops.cp.<name>`; there are no Python wrappers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from cp_compile.ops.core import kv_quant, layout, paged_cache
from cp_compile.ops.core.spec import GE, TRITON_ASCEND, OpDecl
from cp_compile.ops.sparse import launch, reference


# --------------------------------------------------------------------------- DSA indexer


@torch.library.custom_op("cp::lightning_indexer", mutates_args=("index_cache",))
def lightning_indexer(
    q_i: torch.Tensor,  # [T, Hi, Di]
    k_i: torch.Tensor,  # [T, Di]  new indexer keys of this step
    w: torch.Tensor,  # [T, Hi]  per-head weights (scales folded in)
    index_cache: torch.Tensor,  # [NB, BS, Di] written in place
    slot_mapping: torch.Tensor,  # [T] int64
    block_table: torch.Tensor,  # [B, nb] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    topk: int,
) -> torch.Tensor:
    """DeepSeek-V3.2 lightning indexer -> int32 [T, topk] request-local positions.

    Score I[t, s] = sum_j w[t, j] * relu(q_i[t, j] . k_i[s]) over the request's cached
    keys s = 0..pos (causal). Sorted by descending score, ties to the lower position;
    -1 padded when fewer than topk keys exist; padding tokens are all -1.
    """
    paged_cache.check_paged_step((index_cache,), slot_mapping, block_table, seq_lens, query_start_loc,
                               op="cp::lightning_indexer")
    paged_cache.write_cache(index_cache, k_i, slot_mapping)
    T = q_i.shape[0]
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, T)
    return reference.lightning_indexer_topk(q_i, index_cache, w, block_table, query_start_loc, kv_lens, topk)


@lightning_indexer.register_fake
def _lightning_indexer_fake(q_i, k_i, w, index_cache, slot_mapping, block_table, seq_lens,
                            query_start_loc, topk):
    return torch.empty((q_i.shape[0], topk), dtype=torch.int32, device=q_i.device)


# --------------------------------------------------------------------------- sparse MLA (SFA)


@torch.library.custom_op("cp::sparse_mla_attention", mutates_args=("kv_cache",))
def sparse_mla_attention(
    q_nope: torch.Tensor,  # [T, H, L]  absorbed
    q_pe: torch.Tensor,  # [T, H, R]
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [NB, BS, L+R] written in place
    slot_mapping: torch.Tensor,  # [T] int64
    block_table: torch.Tensor,  # [B, nb] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    topk_indices: torch.Tensor,  # [T, K] int32 request-local positions, -1 = skip
    scale: float,
) -> torch.Tensor:
    """Sparse (DSA) absorbed MLA: each query attends only its topk_indices -> [T, H, L].

    The cache is written like `mla_attention`. Indices are trusted (no causal crop):
    the indexer already restricted them to 0..pos, and under SFA DCP they are local
    coordinates where a causal bound would not line up.
    """
    return _sparse_mla_step(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                            query_start_loc, topk_indices, scale)


@sparse_mla_attention.register_fake
def _sparse_mla_attention_fake(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                               query_start_loc, topk_indices, scale):
    return torch.empty_like(q_nope, memory_format=torch.contiguous_format)


# A quantised latent (CPConfig.kv_cache_dtype, issue 39) has its own writing op, whose scale cache
# is a required mutated argument: torchair's auto_functionalized_v2 converter cannot take an
# Optional mutable argument left None, so `cp::sparse_mla_attention` keeps its schema and GE
# graph (decision 66, as `cp::mla_attention_quant`).
@torch.library.custom_op("cp::sparse_mla_attention_quant", mutates_args=("kv_cache", "kv_scale_cache"))
def sparse_mla_attention_quant(
    q_nope: torch.Tensor,  # [T, H, L]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [NB, BS, L+R] int8 / float8_e4m3fn, written in place
    kv_scale_cache: torch.Tensor,  # [NB, BS, 1] fp32, written in place: one scale per token for [c | k_pe]
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    topk_indices: torch.Tensor,  # [T, K] int32
    scale: float,
) -> torch.Tensor:
    """`cp::sparse_mla_attention` over a quantised latent cache (issue 39): the write quantises
    each token's [c | k_pe] with one fp32 scale, the attention dequantises the selected rows."""
    return _sparse_mla_step(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                            query_start_loc, topk_indices, scale, kv_scale_cache)


@sparse_mla_attention_quant.register_fake
def _(q_nope, q_pe, kv_c, k_pe, kv_cache, kv_scale_cache, slot_mapping, block_table, seq_lens, query_start_loc,
      topk_indices, scale):
    return torch.empty_like(q_nope, memory_format=torch.contiguous_format)


def _sparse_mla_step(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, query_start_loc,
                     topk_indices, scale, kv_scale_cache=None):
    """Check, write the latent (quantised with its scales when given), attend the listed positions."""
    paged_cache.check_paged_step((kv_cache,), slot_mapping, block_table, seq_lens, query_start_loc,
                               op="cp::sparse_mla_attention")
    paged_cache.write_latent(kv_cache, kv_c, k_pe, slot_mapping, kv_scale_cache)  # checks the pair first
    L = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, L+R]
    out, _ = reference.sparse_attention_with_lse(q, kv_cache, block_table, query_start_loc, topk_indices, L, scale,
                                                 kv_scale_cache)
    return out



# --------------------------------------------------------------------------- SFA DCP building blocks


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
                                 query_start_loc: Tensor, indices: Tensor, scale: float,
                                 kv_scale_cache: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Partial sparse MLA over the local latent shard: each query attends the listed
    local positions (no causal crop; the indexer applied causality globally).
    q_nope [T,H,L], q_pe [T,H,R], kv_cache [NB,BS,L+R], indices [T,K] (-1 = skip)
    -> out [T,H,L] (q dtype), lse [T,H] fp32 (-inf where the rank holds none of them).
    A quantised latent is dequantised on load with its per-token scales ([NB,BS,1] fp32)."""
    kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")
    q = torch.cat([q_nope, q_pe], dim=-1)
    return reference.sparse_attention_with_lse(q, kv_cache, block_table, query_start_loc, indices,
                                               q_nope.shape[-1], scale, kv_scale_cache)


@sparse_mla_partial_attention.register_fake
def _(q_nope, q_pe, kv_cache, block_table, query_start_loc, indices, scale, kv_scale_cache=None):
    T, H = q_nope.shape[0], q_nope.shape[1]
    return q_nope.new_empty(T, H, q_nope.shape[-1]), q_nope.new_empty(T, H, dtype=torch.float32)



# Every single-device op above assumes the single-device cache layout. Under DCP or PCP
# the caches are laid out differently (sharded latents; the indexer's replicated cache
# only under the SFA DCP pass that allocates and reads it), so a pass must replace or
# claim each of these nodes; the pipeline's final check (passes/unsharded_attention.py)
# refuses a graph that still holds one. A new single-device attention op goes in this
# list (the paged family has its own; `core/catalog.py` joins them).
SINGLE_DEVICE_ATTENTION_OPS: tuple[torch._ops.OpOverloadPacket, ...] = (
    torch.ops.cp.sparse_mla_attention,
    torch.ops.cp.sparse_mla_attention_quant,
    torch.ops.cp.lightning_indexer,
)


# ----------------------------------------------------------------------------- declarations (core/spec.py)
# Every piece of every op above: kernels per device, GE converter, profile bucket.
OPS = (
    OpDecl(lightning_indexer, cuda=launch.lightning_indexer, npu=TRITON_ASCEND,
           ge=GE("ge", "ScatterNdUpdate", "LightningIndexer"), profile="attention"),
    OpDecl(sparse_mla_attention, cuda=launch.sparse_mla_attention, npu=TRITON_ASCEND,
           ge=GE("ge", "ScatterNdUpdate", "SparseFlashAttention"), profile="attention"),
    OpDecl(dcp_sparse_indices, cuda=launch.dcp_sparse_indices, npu=TRITON_ASCEND,
           ge=GE("ge", "Sort", "GatherElements"), profile="dcp_local"),
    OpDecl(sparse_mla_partial_attention, cuda=launch.sparse_mla_partial_attention,
           npu=TRITON_ASCEND, ge=GE("ge", "SparseFlashAttention"), profile="attention"),
    # NPU (int8; fp8 refused by name): the write through cp::quant_cache_write's torch_npu kernel,
    # the read the Triton kernel through triton-ascend (its int8 QUANT launches are in the lowering
    # check). GE: dequantise-on-gather before SparseFlashAttention (ge_quant.py, decision 75).
    OpDecl(sparse_mla_attention_quant, cuda=launch.sparse_mla_attention_quant,
           npu=launch.sparse_mla_attention_quant_npu,
           ge=GE("ge_quant", "ReduceMaxD", "ScatterNdUpdate", "GatherNd", "SparseFlashAttention"), profile="attention"),
)
