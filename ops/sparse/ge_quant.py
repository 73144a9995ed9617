"""GE converters: SFA over a quantised latent cache (issue 39, decision 75).

What CANN offers. `SparseFlashAttention` takes key / value in the query's dtype only
(fp16 / bf16; MindSpore's `ops.sparse_flash_attention` page and torch_npu's
`npu_sparse_flash_attention`). Its quantised twin, `KvQuantSparseFlashAttention`
(Ascend ops-transformer, `attention/kv_quant_sparse_flash_attention/README.md`; the custom
`npu_sparse_flash_attention_antiquant` of the DeepSeek-V3.2-Exp release), takes the key as
one packed row per token, "k_nope (int8), k_rope in the query's dtype and the float32
quantisation parameters concatenated along D" (its Per-Token-Head-Tile-128 scheme: a
scale per 128 nope columns, the rope part unquantised), Q_D 576 only, block size a
multiple of 16. Our latent (decision 69) is the whole [c | k_pe] row in int8 with one fp32
scale per token in a tensor of its own: the rope columns are codes too, and the scales
are not in the row. Feeding that op would mean re-laying out the whole cache per read (or a
second cache layout through every writer, DCP shard and P/D region): not built.

So the mapping is dequantise-on-gather in GE primitives, then the model-dtype
`SparseFlashAttention`: each token's listed rows are gathered (codes and their scales,
`GatherNd` through the block table), dequantised as the reference does on load
(Cast to fp32, Mul by the row's scale, Cast to q's dtype: decision 66), and laid out as a
one-page-per-token paged cache ([T, K, 1, W], PA_BSND with block size K); the attention
then reads page t with block table row t, one query per "request" (TND prefix sums
1..T), and the local indices 0..K-1 where the original index is valid (-1 after: the
valid-first order is kept). The copy is T x K rows in q's dtype, the rows the attention
reads anyway, never the whole cache. Indices are trusted (sparse_mode 0), as in the
model-dtype converters; rows past the last real token get all -1 indices (no key: output 0).

Only int8: an fp8_e4m3 cache would need GE's fp8 Cast on the gathered codes, which the
GE check's evaluator and the NPU paths (decision 70) do not take; refused by name.
"""

from __future__ import annotations

from typing import Any

import torchair
from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge import attr
from torchair.ge._ge_graph import Tensor

from cp_compile.ops.core.ge_kv_quant import I8, quant_scatter_into
from cp_compile.ops.core.ge_util import F32, I32, I64, cast, const, dims, reshape, request_of_token, where

MAX_INT64 = (1 << 63) - 1


def sparse_flash_attrs(scale: float, lse: bool, sparse_mode: int = 0) -> dict[str, Any]:
    """SparseFlashAttention's attributes as every converter of the family sets them: TND queries
    over page-attention BSND keys, one key per sparse block, no window (pre / next tokens
    unbounded); `sparse_mode` 0 trusts the indices (the indexer applied causality), 3 is the
    causal mask the single-device op asks for; the LSE only where a merge reads it."""
    return {
        "scale_value": attr.Float(float(scale)),
        "sparse_block_size": attr.Int(1),
        "layout_query": attr.Str("TND"),
        "layout_kv": attr.Str("PA_BSND"),
        "sparse_mode": attr.Int(sparse_mode),
        "pre_tokens": attr.Int(MAX_INT64),
        "next_tokens": attr.Int(MAX_INT64),
        "attention_mode": attr.Int(0),
        "return_softmax_lse": attr.Bool(lse),
    }


def refuse_fp8(op: str, kv_cache: Tensor) -> None:
    """An fp8 latent has no mapping here (see the module text); refused, never read as int8."""
    if kv_cache.dtype != I8:
        raise NotImplementedError(
            f"{op}: the GE converter dequantises an int8 latent cache before SparseFlashAttention, and this cache "
            f"is not int8 (GE dtype {kv_cache.dtype}): no fp8 key / value on the NPU (decision 70). "
            "Fix: CPConfig(kv_cache_dtype='int8') on the NPU, or run the fp8 cache on CPU / CUDA (Triton)")


def _num_rows(x: Tensor) -> Tensor:
    return ge.GatherV2(ge.Shape(x, dtype=I64), const(0, I64), const(0, I64))  # scalar int64


def dequant_gather(kv_cache: Tensor, kv_scale_cache: Tensor, block_table: Tensor, req: Tensor, indices: Tensor,
                   dtype: int) -> Tensor:
    """The rows each token lists, dequantised: [T, K, 1, W] in `dtype` (a page of K per token).

    kv_cache [NB, BS, W] int8, kv_scale_cache [NB, BS, 1] fp32, block_table [B, nb],
    req [T] int64 (each token's block-table row), indices [T, K] request-local positions
    (-1: skip; read as position 0, masked by the caller's indices)."""
    T, K = dims(indices)
    bs = int(kv_cache.meta.shape[1])
    width = int(kv_cache.meta.shape[-1])
    pos = ge.Maximum(cast(indices, I64), const(0, I64))  # [T, K]
    rows = ge.GatherV2(cast(block_table, I64), req, const(0, I64))  # [T, nb]
    block = ge.GatherElements(rows, ge.FloorDiv(pos, const(bs, I64)), dim=1)  # [T, K]
    at = ge.Pack([block, ge.FloorMod(pos, const(bs, I64))], N=2, axis=2)  # [T, K, 2]
    codes = ge.GatherNd(kv_cache, at)  # [T, K, W] int8
    scales = ge.GatherNd(kv_scale_cache, at)  # [T, K, 1] fp32: one scale for the whole [c | k_pe] row
    rows_q = ge.Cast(ge.Mul(ge.Cast(codes, dst_type=F32), scales), dst_type=dtype)  # [T, K, W]
    return reshape(rows_q, [T, K, 1, width])


def sparse_flash_per_token(q_nope: Tensor, q_pe: Tensor, pages: Tensor, indices: Tensor, real: Tensor,
                           scale: float, *, lse: bool):
    """SparseFlashAttention over `dequant_gather`'s pages: token t is request t of one query,
    its page is block t, its keys the K gathered rows; index k kept where the original
    index is valid and the token is real. Returns (out [T, H, L], lse [T, H] fp32 or None)."""
    T, H, L = dims(q_nope)
    K = int(indices.meta.shape[-1])
    n = _num_rows(q_nope)
    col = ge.Unsqueeze(ge.Range(const(0, I32), const(K, I32), const(1, I32)), axes=[0])  # [1, K]
    keep = ge.LogicalAnd(ge.GreaterEqual(cast(indices, I32), const(0, I32)), ge.Unsqueeze(real, axes=[1]))
    local = where(keep, ge.Add(ge.Mul(cast(indices, I32), const(0, I32)), col), const(-1, I32))  # [T, K]
    out, smax, ssum = torchair.ge.custom_op(
        "SparseFlashAttention",
        inputs={
            "query": ge.ConcatV2([q_nope, q_pe], const(2, I32), N=2),
            "key": pages,
            "value": pages,
            "sparse_indices": reshape(local, [T, 1, K]),
            "block_table": cast(reshape(ge.Range(const(0, I64), n, const(1, I64)), [T, 1]), I32),
            "actual_seq_lengths_query": cast(ge.Range(const(1, I64), ge.Add(n, const(1, I64)), const(1, I64)), I32),
            "actual_seq_lengths_kv": ge.Add(ge.Mul(cast(ge.Range(const(0, I64), n, const(1, I64)), I32),
                                                   const(0, I32)), const(K, I32)),
            "query_rope": None,
            "key_rope": None,
        },
        attrs=sparse_flash_attrs(scale, lse),
        outputs=["attention_out", "softmax_max", "softmax_sum"],
    )
    out = reshape(ge.Slice(out, const([0, 0, 0], I64), const([-1, -1, int(L)], I64)), [T, H, L])
    if not lse:
        return out, None
    return out, reshape(ge.Add(cast(smax, F32), ge.Log(cast(ssum, F32))), [T, H])


def quant_partial(op: str, q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, kv_scale_cache: Tensor,
                  block_table: Tensor, req: Tensor, real: Tensor, indices: Tensor, scale: float, *, lse: bool):
    """The quantised sparse read shared by the three converters (the partial, the DSA-CP rows,
    the single-device op after its write)."""
    refuse_fp8(op, kv_cache)
    pages = dequant_gather(kv_cache, kv_scale_cache, block_table, req, indices, q_nope.dtype)
    return sparse_flash_per_token(q_nope, q_pe, pages, indices, real, scale, lse=lse)


def convert_sparse_mla_attention_quant(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                                       kv_scale_cache: Tensor, slot_mapping: Tensor, block_table: Tensor,
                                       seq_lens: Tensor, query_start_loc: Tensor, topk_indices: Tensor, scale: float,
                                       meta_outputs: Any = None):
    op = "cp::sparse_mla_attention_quant"
    refuse_fp8(op, kv_cache)  # before the write is built
    latent = ge.ConcatV2([kv_c, k_pe], const(1, I32), N=2)  # [T, L+R]
    written, scales = quant_scatter_into(kv_cache, kv_scale_cache, latent, slot_mapping)
    req, real = request_of_token(query_start_loc, q_nope)
    out, _ = quant_partial(op, q_nope, q_pe, written, scales, block_table, req, real, topk_indices, scale,
                           lse=False)
    return out
