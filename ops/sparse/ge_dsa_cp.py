"""GE converters: the DSA-CP token-shard ops (ops/sparse/dsa_cp.py, docs/dsa_cp.md).

Both ops work on this rank's rows [rank * rows, (rank + 1) * rows) of the step's
padded tokens, with global metadata. The NPU kernels take queries in the TND layout
(cumulative query counts per request) and a key length per request, so the
converters describe the shard per request, as `layout.shard_request_lens` does:
n_b = clamp(min(qe, end) - max(qs, start), 0) local queries of request b and
k_b = n_b > 0 ? max(seq_len_b - (qe - min(qe, end)), 0) : 0 keys, so that a
bottom-right causal mask gives each local row its single-device causal length.

- `cp::lightning_indexer_topk_rows` -> `LightningIndexer` (TND query over the rows,
  PA_BSND key over the full index cache, sparse_mode 3 = causal, sparse_count =
  topk), no cache write (the composition writes every key with `cp::cache_write`);
  rows past the shard's last real token (padding) are set to -1 with `SelectV2`.
- `cp::sparse_mla_rows_attention` -> `SparseFlashAttention` over the full latent
  cache (sparse_mode 0: the indices are trusted), first L output columns, padding
  rows set to 0. With a `kv_scale_cache` (an int8 latent, issue 39): each row's listed
  rows gathered and dequantised first (`ge_quant.py`, decision 75).
The kernels' treatment of rows past the last cumulative query count is not
documented, hence the explicit masks (not verifiable without an NPU).
"""

from __future__ import annotations

from typing import Any

import torchair
from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import Tensor

from cp_compile.ops.core.ge_util import I32, I64, cast, const, dims, head, reshape, tail, where
from cp_compile.ops.sparse.ge import _paged, lightning_indexer_op
from cp_compile.ops.sparse.ge_quant import quant_partial, sparse_flash_attrs


def _shard_tnd(q: Tensor, query_start_loc: Tensor, seq_lens: Tensor, rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """(cumulative local query counts [B] int32, local key lengths [B] int32,
    row-is-real [rows] bool) of this rank's row shard (rows = q's first dim)."""
    rows = ge.GatherV2(ge.Shape(q, dtype=I64), const(0, I64), const(0, I64))  # scalar
    start = ge.Mul(rows, const(rank, I64))
    end = ge.Add(start, rows)
    qsl = cast(query_start_loc, I64)
    qs, qe = head(qsl), tail(qsl)  # [B]
    ls, le = ge.Maximum(qs, start), ge.Minimum(qe, end)
    n = ge.Maximum(ge.Sub(le, ls), const(0, I64))
    k = ge.Maximum(ge.Sub(cast(seq_lens, I64), ge.Sub(qe, le)), const(0, I64))
    k = where(ge.Greater(n, const(0, I64)), k, const(0, I64))
    cum = ge.Cumsum(n, const(0, I32))  # [B]
    real = ge.Less(ge.Range(const(0, I64), rows, const(1, I64)), ge.ReduceSumD(n, axes=[0], keep_dims=False))
    return cast(cum, I32), cast(k, I32), real


def _row_requests(q: Tensor, query_start_loc: Tensor, rank: int) -> Tensor:
    """[rows] int64: the request of each row of this rank's shard (global token rank * rows + r),
    #{b : qsl[b+1] <= t} clamped to B - 1 (padding rows: masked by `real`)."""
    rows = ge.GatherV2(ge.Shape(q, dtype=I64), const(0, I64), const(0, I64))
    t = ge.Add(ge.Range(const(0, I64), rows, const(1, I64)), ge.Mul(rows, const(rank, I64)))  # [rows]
    ends = tail(cast(query_start_loc, I64))  # [B]
    le = cast(ge.LessEqual(ge.Unsqueeze(ends, axes=[0]), ge.Unsqueeze(t, axes=[1])), I64)  # [rows, B]
    last_b = ge.Sub(ge.GatherV2(ge.Shape(ends, dtype=I64), const(0, I64), const(0, I64)), const(1, I64))
    return ge.Minimum(ge.ReduceSumD(le, axes=[1], keep_dims=False), last_b)


def convert_lightning_indexer_topk_rows(q_i: Tensor, index_cache: Tensor, w: Tensor, block_table: Tensor,
                                        seq_lens: Tensor, query_start_loc: Tensor, tp: int, rank: int, topk: int,
                                        meta_outputs: Any = None):
    rows = dims(q_i)[0]
    cum, k, real = _shard_tnd(q_i, query_start_loc, seq_lens, rank)
    indices = lightning_indexer_op(q_i, index_cache, int(index_cache.meta.shape[-1]), w, cum, k, block_table, topk)
    indices = cast(reshape(indices, [rows, int(topk)]), I32)
    return where(ge.Unsqueeze(real, axes=[1]), indices, const(-1, I32))


def convert_sparse_mla_rows_attention(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                                      seq_lens: Tensor, query_start_loc: Tensor, indices: Tensor, tp: int, rank: int,
                                      scale: float, kv_scale_cache: Any = None, meta_outputs: Any = None):
    T, H, L = dims(q_nope)
    K = int(indices.meta.shape[-1])
    width = int(kv_cache.meta.shape[-1])
    cum, k, real = _shard_tnd(q_nope, query_start_loc, seq_lens, rank)
    if kv_scale_cache is not None:  # an int8 latent: dequantise-on-gather (ge_quant.py, decision 75)
        out, _ = quant_partial("cp::sparse_mla_rows_attention", q_nope, q_pe, kv_cache, kv_scale_cache, block_table,
                               _row_requests(q_nope, query_start_loc, rank), real, indices, scale, lse=False)
        return out
    out, _, _ = torchair.ge.custom_op(
        "SparseFlashAttention",
        inputs={
            "query": ge.ConcatV2([q_nope, q_pe], const(2, I32), N=2),
            "key": _paged(kv_cache, width),
            "value": _paged(kv_cache, width),
            "sparse_indices": reshape(cast(indices, I32), [T, 1, K]),
            "block_table": cast(block_table, I32),
            "actual_seq_lengths_query": cum,
            "actual_seq_lengths_kv": k,
            "query_rope": None,
            "key_rope": None,
        },
        attrs=sparse_flash_attrs(scale, False),
        outputs=["attention_out", "softmax_max", "softmax_sum"],
    )
    out = reshape(ge.Slice(out, const([0, 0, 0], I64), const([-1, -1, int(L)], I64)), [T, H, L])
    zero = ge.ZerosLike(out)
    return where(ge.Unsqueeze(ge.Unsqueeze(real, axes=[1]), axes=[2]), out, zero)
