"""DSA-CP building blocks as custom ops (docs/dsa_cp.md).

DSA-CP shards the queries of the lightning indexer and of sparse MLA by tokens over
the TP group: rank r owns the rows [r * rows, (r + 1) * rows) of the step's tokens
padded to tp * rows (`layout.token_shard_rows`). The two ops here are the
single-device `cp::lightning_indexer` top-k and `cp::sparse_mla_attention` restricted
to such a row shard; each derives its rows' request and causal length from the
*global* metadata (`layout.shard_row_metadata`), so a row gets exactly what that
token gets on one device. Neither writes a cache: the compositions in
`cp_compile.ops.parallel.dsa_cp` write every token's keys with `cp::cache_write`, and
collectives stay outside the ops as `_c10d_functional` nodes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cp_compile.ops.core import kv_quant, layout
from cp_compile.ops.core.spec import GE, TRITON_ASCEND, OpDecl
from cp_compile.ops.sparse import launch, reference


def _rows(query_start_loc: Tensor, seq_lens: Tensor, rows: int, tp: int, rank: int) -> tuple[Tensor, Tensor]:
    return layout.shard_row_metadata(query_start_loc, seq_lens, rows, tp=tp, rank=rank)


@torch.library.custom_op("cp::lightning_indexer_topk_rows", mutates_args=())
def lightning_indexer_topk_rows(q_i: Tensor, index_cache: Tensor, w: Tensor, block_table: Tensor,
                                seq_lens: Tensor, query_start_loc: Tensor, tp: int, rank: int,
                                topk: int) -> Tensor:
    """Lightning-indexer top-k of this rank's token shard -> int32 [rows, topk].

    q_i [rows, Hi, Di] and w [rows, Hi] are the rows [rank * rows, (rank + 1) * rows)
    of the step's (padded) tokens; index_cache [NB, BS, Di] already holds every token
    of the step. Metadata is global. Row i equals row rank * rows + i of
    `cp::lightning_indexer` on one device (bit for bit: same scores, same stable
    sort); padding rows are all -1.
    """
    req, kv_lens = _rows(query_start_loc, seq_lens, q_i.shape[0], tp, rank)
    return reference.lightning_indexer_topk_rows(q_i, index_cache, w, block_table, req, kv_lens, topk)


@lightning_indexer_topk_rows.register_fake
def _(q_i, index_cache, w, block_table, seq_lens, query_start_loc, tp, rank, topk):
    return torch.empty((q_i.shape[0], topk), dtype=torch.int32, device=q_i.device)


@torch.library.custom_op("cp::sparse_mla_rows_attention", mutates_args=())
def sparse_mla_rows_attention(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                              seq_lens: Tensor, query_start_loc: Tensor, indices: Tensor, tp: int, rank: int,
                              scale: float, kv_scale_cache: Optional[Tensor] = None) -> Tensor:
    """Sparse absorbed MLA of this rank's token shard, all heads -> [rows, H, L].

    q_nope [rows, H, L], q_pe [rows, H, R] (every head of the shard's tokens, after the
    DSA-CP all-to-all), kv_cache [NB, BS, L+R] (the full latent cache, already
    written), indices [rows, K] request-local positions from
    `cp::lightning_indexer_topk_rows` (trusted, no causal crop, -1 = skip). Padding
    rows give 0. Same math as `cp::sparse_mla_attention` per row. A quantised latent is
    dequantised on load with its per-token scales (`kv_scale_cache` [NB, BS, 1] fp32).
    """
    kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")
    req, _ = _rows(query_start_loc, seq_lens, q_nope.shape[0], tp, rank)
    q = torch.cat([q_nope, q_pe], dim=-1)  # [rows, H, L+R]
    return reference.sparse_attention_rows_with_lse(q, kv_cache, block_table, req, indices, q_nope.shape[-1],
                                                    scale, kv_scale_cache)[0]


@sparse_mla_rows_attention.register_fake
def _(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, indices, tp, rank, scale, kv_scale_cache=None):
    return torch.empty_like(q_nope, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- declarations (core/spec.py)
# Every piece of every op above: kernels per device, GE converter, profile bucket.
OPS = (
    OpDecl(lightning_indexer_topk_rows, cuda=launch.lightning_indexer_topk_rows, npu=TRITON_ASCEND,
           ge=GE("ge_dsa_cp", "Cumsum", "LightningIndexer", "SelectV2"), profile="attention"),
    OpDecl(sparse_mla_rows_attention, cuda=launch.sparse_mla_rows_attention, npu=TRITON_ASCEND,
           ge=GE("ge_dsa_cp", "Cumsum", "SparseFlashAttention", "SelectV2"), profile="attention"),
)
