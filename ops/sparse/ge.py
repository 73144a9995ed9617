"""GE converters: the DSA / SFA ops (lightning indexer, sparse MLA attention).

torchair has no generated builders for these CANN ops (they live in CANN's
ops-transformer package), so they are built with `torchair.ge.custom_op`, with the
input, attribute and output names of torchair's own converters for torch_npu's
`npu_lightning_indexer` / `npu_sparse_flash_attention`:

- `cp::lightning_indexer` -> `ScatterNdUpdate` (write the indexer keys) +
  `LightningIndexer` (layout_query TND, layout_key PA_BSND over the paged index
  cache, sparse_count = topk, sparse_mode 3 = causal); output `sparse_indices`
  [T, 1, topk] int32 -> [T, topk].
- `cp::sparse_mla_attention` -> `ScatterNdUpdate` (write [c | k_pe]) +
  `SparseFlashAttention` over the whole [L+R] cache row (key = value = the cache,
  query = [q_nope | q_pe]) keeping the first L output columns, as for dense MLA
  (see attention.py); `sparse_indices` = topk_indices as [T, 1, K].
- `cp::sparse_mla_partial_attention` (SFA DCP partial) -> `SparseFlashAttention`
  the same way, with `return_softmax_lse` = true: the LSE is
  softmax_max + log(softmax_sum) of its two statistics outputs, read as [T, H]
  (that output layout is torch_npu's documented one, not verifiable here). With a
  `kv_scale_cache` (an int8 latent, issue 39): the listed rows gathered and dequantised
  first (`ge_quant.py`, decision 75), then the same `SparseFlashAttention`.
- `cp::dcp_sparse_indices` (SFA DCP: global top-k -> this rank's local positions)
  -> GE primitives for the owner test and the local offset (ops/core/layout.py), then a
  stable `Sort` of "not owned" and `GatherElements`, the reference's compaction.
"""

from __future__ import annotations

from typing import Any

import torchair
from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge import attr
from torchair.ge._ge_graph import Tensor

from cp_compile.ops.core.ge_util import F32, I32, I64, cast, const, dims, local_len, reshape, tail, where
from cp_compile.ops.core.ge_util import request_of_token, scatter_into
from cp_compile.ops.sparse.ge_quant import MAX_INT64, quant_partial, sparse_flash_attrs


def _paged(cache: Tensor, width: int) -> Tensor:
    """[NB, BS, W] -> [NB, BS, 1, W] (PA_BSND, one KV head)."""
    d = dims(cache)
    return reshape(cache, [d[0], d[1], 1, width])


def convert_lightning_indexer(q_i: Tensor, k_i: Tensor, w: Tensor, index_cache: Tensor, slot_mapping: Tensor,
                              block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, topk: int,
                              meta_outputs: Any = None):
    T = dims(q_i)[0]
    written = scatter_into(index_cache, k_i, slot_mapping)
    written.set_meta(index_cache.meta)
    indices = lightning_indexer_op(q_i, written, int(index_cache.meta.shape[-1]), w,
                                   cast(tail(cast(query_start_loc, I64)), I32), cast(seq_lens, I32),
                                   block_table, topk)
    return reshape(indices, [T, int(topk)])


def lightning_indexer_op(q_i: Tensor, index_cache: Tensor, key_dim: int, w: Tensor, cum_query_lens: Tensor,
                         key_lens: Tensor, block_table: Tensor, topk: int) -> Tensor:
    """CANN `LightningIndexer`: TND queries (cumulative counts per request) over the
    paged index cache (PA_BSND), causal (sparse_mode 3) -> `sparse_indices`.
    Shared by the single-device indexer and the DSA-CP row shard."""
    indices, _ = torchair.ge.custom_op(
        "LightningIndexer",
        inputs={
            "query": q_i,
            "key": _paged(index_cache, key_dim),
            "weights": w,
            "actual_seq_lengths_query": cum_query_lens,
            "actual_seq_lengths_key": key_lens,
            "block_table": cast(block_table, I32),
        },
        attrs={
            "layout_query": attr.Str("TND"),
            "layout_key": attr.Str("PA_BSND"),
            "sparse_count": attr.Int(int(topk)),
            "sparse_mode": attr.Int(3),
            "pre_tokens": attr.Int(MAX_INT64),
            "next_tokens": attr.Int(MAX_INT64),
            "return_values": attr.Bool(False),
        },
        outputs=["sparse_indices", "sparse_values"],
    )
    return indices


def convert_sparse_mla_attention(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                                 slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor,
                                 query_start_loc: Tensor, topk_indices: Tensor, scale: float,
                                 meta_outputs: Any = None):
    T, H, L = dims(q_nope)
    width = int(kv_cache.meta.shape[-1])
    written = scatter_into(kv_cache, ge.ConcatV2([kv_c, k_pe], const(1, I32), N=2), slot_mapping)
    written.set_meta(kv_cache.meta)
    out, _, _ = _sparse_flash(q_nope, q_pe, _paged(written, width), width, topk_indices, block_table,
                              query_start_loc, seq_lens, scale, lse=False)
    out = ge.Slice(out, const([0, 0, 0], I64), const([-1, -1, int(L)], I64))
    return reshape(out, [T, H, L])


def _capacity(block_table: Tensor, block_size: int) -> Tensor:
    """[B] int32, every entry the block-table row's capacity (blocks x block size): the
    page requires actual_seq_lengths_kv with PA_BSND; the SFA DCP partial trusts its
    (local) indices and has no per-request length."""
    nb, bs = int(block_table.meta.shape[1]), int(block_size)
    rows = ge.GatherV2(cast(block_table, I32), const(0, I64), const(1, I64))  # [B]: column 0
    return ge.Add(ge.Mul(rows, const(0, I32)), const(nb * bs, I32))


def _sparse_flash(q_nope: Tensor, q_pe: Tensor, cache: Tensor, width: int, indices: Tensor, block_table: Tensor,
                  query_start_loc: Tensor, seq_lens: Tensor, scale: float, *, lse: bool):
    T = dims(q_nope)[0]
    K = int(indices.meta.shape[-1])
    inputs = {
        "query": ge.ConcatV2([q_nope, q_pe], const(2, I32), N=2),
        "key": cache,
        "value": cache,
        "sparse_indices": reshape(cast(indices, I32), [T, 1, K]),
        "block_table": cast(block_table, I32),
        "actual_seq_lengths_query": cast(tail(cast(query_start_loc, I64)), I32),
        "actual_seq_lengths_kv": cast(seq_lens, I32),
        "query_rope": None,
        "key_rope": None,
    }
    return torchair.ge.custom_op(
        "SparseFlashAttention",
        inputs=inputs,
        attrs=sparse_flash_attrs(scale, lse, 0 if lse else 3),
        outputs=["attention_out", "softmax_max", "softmax_sum"],
    )


def convert_sparse_mla_partial_attention(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                                         query_start_loc: Tensor, indices: Tensor, scale: float,
                                         kv_scale_cache: Any = None, meta_outputs: Any = None):
    if kv_scale_cache is not None:  # a quantised latent: dequantise-on-gather (ge_quant.py, decision 75)
        req, real = request_of_token(query_start_loc, q_nope)
        return quant_partial("cp::sparse_mla_partial_attention", q_nope, q_pe, kv_cache, kv_scale_cache,
                             block_table, req, real, indices, scale, lse=True)
    T, H, L = dims(q_nope)
    width = int(kv_cache.meta.shape[-1])
    # No causal crop (sparse_mode 0): the indices are local positions chosen by the indexer.
    out, smax, ssum = _sparse_flash(q_nope, q_pe, _paged(kv_cache, width), width, indices, block_table,
                                    query_start_loc, _capacity(block_table, int(kv_cache.meta.shape[1])), scale,
                                    lse=True)
    out = ge.Slice(out, const([0, 0, 0], I64), const([-1, -1, int(L)], I64))
    lse = ge.Add(cast(smax, F32), ge.Log(cast(ssum, F32)))
    return reshape(out, [T, H, L]), reshape(lse, [T, H])


def convert_dcp_sparse_indices(topk_indices: Tensor, cp: int, rank: int, interleave: int, block_size: int,
                               meta_outputs: Any = None):
    idx = cast(topk_indices, I64)
    pos = ge.Maximum(idx, const(0, I64))
    off = ge.FloorMod(pos, const(block_size * cp, I64))
    owner = ge.FloorMod(ge.FloorDiv(off, const(interleave, I64)), const(cp, I64))
    owned = ge.LogicalAnd(ge.GreaterEqual(idx, const(0, I64)), ge.Equal(owner, const(rank, I64)))
    local = where(owned, local_len(pos, cp, rank, interleave), const(-1, I64))
    # Stable compaction: a stable ascending sort of "not owned" keeps the owned entries' order.
    _, order = ge.Sort(cast(ge.LogicalNot(owned), I32), axis=-1, descending=False, stable=True)
    return cast(ge.GatherElements(local, order, dim=-1), topk_indices.dtype)
