"""GE converters: paged attention with LSE (GQA, MLA) and the single-device ops.

All attention maps to CANN's fused infer-attention op `FusedInferAttentionScore`
(torch_npu's `npu_fused_infer_attention_score`, the op vLLM-Ascend's attention
backends call), through torchair's generated builder `ge.FusedInferAttentionScore`
so a wrong argument fails in Python:

- `cp::paged_attention_lse` (DCP partial, GQA) and `cp::mla_partial_attention`
  (DCP partial, absorbed MLA): every query token is its own batch row (layout
  BSND with S = 1), so the per-token local key count `kv_lens[t]` (which under
  DCP is not a right-aligned causal window) is exactly `actual_seq_lengths_kv`;
  the token's block-table row is gathered from its request. `softmax_lse_flag`
  returns the LSE. Paged caches go in as [NB, BS, H*D] with `block_size`.
- MLA attends the whole cached [c | k_pe] vector (D = L + R) with value = the same
  cache and keeps the first L output columns: softmax(QK^T)[c | k_pe] = [out | .],
  so no per-step copy of the cache is made to split it (the cost: R/(L+R) more P.V
  work). vLLM-Ascend instead keeps separate nope / rope caches and passes
  `query_rope` / `key_rope`; our cache layout stores one [L+R] row per token.
- `cp::gqa_paged_attention` / `cp::mla_attention` (dcp = 1): the cache writes
  (`ScatterNdUpdate`, as `cp::cache_write`), then
  the same attention with one-device causal lengths `pos + 1`.
- A quantised int8 cache (issue 39, decision 70): the reads pass the scale caches as FIA's
  `key_antiquant_scale` / `value_antiquant_scale`, per-token scales managed by page
  attention (mode 5 for GQA, transposed to (blocknum, N, blocksize); mode 4 for the MLA
  latent, (blocknum, blocksize)); the quant ops' writes quantise in GE primitives
  (`core/ge_kv_quant.py`) before the scatters. fp8 pages are refused (no FIA input).
"""

from __future__ import annotations

from typing import Any, Optional

from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import DataType, Tensor

from cp_compile.ops.core.ge_util import (F32, I32, I64, cast, const, dims, request_of_token, reshape, scatter_into,
                                         token_positions, where)
from cp_compile.ops.core.ge_kv_quant import quant_scatter_into
from cp_compile.ops.core.kv_quant import refuse_static_scale

MAX_INT32 = 2147483647


def fia_lse(lse: Tensor) -> Tensor:
    """FIA's LSE with its +inf reading of a row without keys made -inf (empty).

    CANN's FIA page calls inf LSE data "invalid" and does not say what a row without
    keys gives; the check evaluates -inf and +inf there (docs/torchair.md). That
    reading is handled here, at the FIA boundary only: a NaN passes, and the merges
    make its row NaN (decision 47)."""
    return where(ge.Equal(lse, const(float("inf"), F32)), const(float("-inf"), F32), lse)


def _paged_per_token(q: Tensor, q_like: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, query_start_loc: Tensor,
                     kv_lens: Tensor, scale: float, *, heads: int, kv_heads: int, head_dim: int, block_size: int,
                     antiquant: Optional[tuple[Tensor, Tensor, int]] = None) -> tuple[Tensor, Tensor]:
    """q [T, H, D], caches [NB, BS, Hkv*D] -> (out [T, 1, H, Dv], lse [T, H, 1, 1]) via FusedInferAttentionScore.

    `antiquant`: (key scale, value scale, mode) for an int8 cache, FIA's per-token antiquant
    scales managed by page attention (`antiquant_scales`); no offsets (symmetric codes)."""
    T = dims(q_like)[0]
    req, _ = request_of_token(query_start_loc, q_like)
    table = ge.GatherV2(cast(block_table, I32), req, const(0, I64))  # [T, nb]: each token's request row
    query = reshape(q, [T, 1, heads, head_dim])
    k_scale, v_scale, mode = antiquant if antiquant is not None else (None, None, 0)
    return ge.FusedInferAttentionScore(
        query, [k_cache], [v_cache], None, None, None, cast(kv_lens, I64),
        None, None, None, None, None, None, None, table, None, None,
        k_scale, None, v_scale, None,  # key / value antiquant scale and offset (symmetric codes: no offset)
        None, None, None, None, None, None, None, None, None, None,
        num_heads=heads, scale=float(scale), pre_tokens=MAX_INT32, next_tokens=MAX_INT32, input_layout="BSND",
        num_key_value_heads=kv_heads, sparse_mode=0, block_size=block_size, softmax_lse_flag=True,
        key_antiquant_mode=mode, value_antiquant_mode=mode)


def _flat_cache(cache: Tensor) -> Tensor:
    """[NB, BS, H, D] or [NB, BS, D] -> [NB, BS, H*D] (the paged layout BSND reads)."""
    NB, BS, *rest = cache.meta.shape
    width = 1
    for d in rest:
        width *= int(d)
    return reshape(cache, [dims(cache)[0], int(BS), width])


# FIA's per-token antiquant modes whose scales page attention manages (torch_npu's
# npu_fused_infer_attention_score page, Ascend/op-plugin docs/context/
# torch_npu-npu_fused_infer_attention_score.md, "管理scale/offset的量化模式", Q_S = 1 table):
# 4 = per-token, scales (blocknum, blocksize); 5 = per-token and per-head, scales
# (blocknum, N, blocksize); fp32, key / value int8 only; modes 2-5 only for Q_S = 1, which
# the one-batch-row-per-token layout always is. FIA's Ascend IR (torch-npu 2.13.0's
# REG_OP text) takes key / value as int8, fp16 or bf16: no fp8, so an fp8_e4m3 cache has no
# FIA mapping (refused by name, below).
PER_TOKEN_PAGED = 4
PER_TOKEN_HEAD_PAGED = 5


def refuse_fp8(op: str, *caches: Tensor) -> None:
    """An fp8 page has no FIA input (key / value: int8, fp16, bf16); refused by name, never
    read as another dtype."""
    for c in caches:
        if c.dtype != DataType.DT_INT8:
            raise NotImplementedError(
                f"{op}: the GE converter maps a quantised KV cache to FusedInferAttentionScore's int8 antiquant "
                f"inputs, and this cache is not int8 (GE dtype {c.dtype}): FIA's key / value take int8, fp16 or "
                "bf16, no fp8 (its Ascend IR). Fix: CPConfig(kv_cache_dtype='int8') on the NPU, or run the fp8 "
                "cache on CPU / CUDA (Triton)")


def gqa_scales(k_scale_cache: Tensor, v_scale_cache: Tensor) -> tuple[Tensor, Tensor, int]:
    """[NB, BS, Hkv] fp32 scale caches -> FIA mode 5's (blocknum, N, blocksize): a transposed
    copy per call (4 bytes per cached token and head; storing the scales head-major would
    save it, but every other reader and the P/D transfer use the token-major layout)."""
    return (ge.TransposeD(k_scale_cache, perm=[0, 2, 1]), ge.TransposeD(v_scale_cache, perm=[0, 2, 1]),
            PER_TOKEN_HEAD_PAGED)


def mla_scales(kv_scale_cache: Tensor) -> tuple[Tensor, Tensor, int]:
    """[NB, BS, 1] fp32 latent scales -> FIA mode 4's (blocknum, blocksize), for key and value
    alike (key = value = the cached [c | k_pe] row, one scale per token)."""
    flat = reshape(kv_scale_cache, [dims(kv_scale_cache)[0], int(kv_scale_cache.meta.shape[1])])
    return flat, flat, PER_TOKEN_PAGED


def gqa_partial(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_scale_cache=None,
                v_scale_cache=None):
    T, H, _ = dims(q)
    Hkv, Dv = int(v_cache.meta.shape[2]), int(v_cache.meta.shape[3])
    antiquant = None
    if k_scale_cache is not None or v_scale_cache is not None:
        refuse_fp8("cp::paged_attention_lse", k_cache, v_cache)
        antiquant = gqa_scales(k_scale_cache, v_scale_cache)
    out, lse = _paged_per_token(q, q, _flat_cache(k_cache), _flat_cache(v_cache), block_table, query_start_loc,
                                kv_lens, scale, heads=int(H), kv_heads=Hkv, head_dim=int(q.meta.shape[2]),
                                block_size=int(k_cache.meta.shape[1]), antiquant=antiquant)
    return reshape(out, [T, H, Dv]), fia_lse(reshape(lse, [T, H]))


def mla_partial(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale, kv_scale_cache=None):
    T, H, L = dims(q_nope)
    q = ge.ConcatV2([q_nope, q_pe], const(2, I32), N=2)  # [T, H, L+R]
    cache = _flat_cache(kv_cache)  # [NB, BS, L+R]
    antiquant = None
    if kv_scale_cache is not None:
        refuse_fp8("cp::mla_partial_attention", kv_cache)
        antiquant = mla_scales(kv_scale_cache)
    out, lse = _paged_per_token(q, q_nope, cache, cache, block_table, query_start_loc, kv_lens, scale,
                                heads=int(H), kv_heads=1, head_dim=int(kv_cache.meta.shape[-1]),
                                block_size=int(kv_cache.meta.shape[1]), antiquant=antiquant)
    out = ge.Slice(out, const([0, 0, 0, 0], I64), const([-1, -1, -1, int(L)], I64))  # value = c: first L columns
    return reshape(out, [T, H, L]), fia_lse(reshape(lse, [T, H]))


def convert_paged_attention_lse(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                                query_start_loc: Tensor, kv_lens: Tensor, scale: float, k_scale_cache: Any = None,
                                v_scale_cache: Any = None, meta_outputs: Any = None):
    return gqa_partial(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_scale_cache,
                       v_scale_cache)


def convert_mla_partial_attention(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                                  query_start_loc: Tensor, kv_lens: Tensor, scale: float, kv_scale_cache: Any = None,
                                  meta_outputs: Any = None):
    return mla_partial(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale, kv_scale_cache)


def causal_lens(query_start_loc: Tensor, seq_lens: Tensor, like: Tensor) -> Tensor:
    """core/layout.causal_lens: pos + 1, 0 for padding (int64)."""
    pos, _, valid, _ = token_positions(query_start_loc, seq_lens, like)
    return where(valid, ge.Add(pos, const(1, I64)), const(0, I64))


def convert_gqa_paged_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                                slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                                scale: float, meta_outputs: Any = None):
    # Not ScatterPaKvCache: its page requires every slot in [0, blocks * block_size) and
    # unique; padding tokens (slot -1) all go to the scratch block's one slot. The same
    # write as the DCP path instead.
    k_new, v_new = scatter_into(k_cache, k, slot_mapping), scatter_into(v_cache, v, slot_mapping)
    k_new.set_meta(k_cache.meta)
    v_new.set_meta(v_cache.meta)
    k_cache, v_cache = k_new, v_new
    return _gqa_after_write(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale)


def _gqa_after_write(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, k_scale_cache=None,
                     v_scale_cache=None):
    out, _ = gqa_partial(q, k_cache, v_cache, block_table, query_start_loc,
                         causal_lens(query_start_loc, seq_lens, q), scale, k_scale_cache, v_scale_cache)
    return out


def convert_gqa_paged_attention_quant(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                                      k_scale_cache: Tensor, v_scale_cache: Tensor, slot_mapping: Tensor,
                                      block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, scale: float,
                                      k_static_scale: Any = None, v_static_scale: Any = None,
                                      meta_outputs: Any = None):
    # The write of cp::quant_cache_write (codes and scales, each by ScatterNdUpdate), then the
    # partial's FIA with the antiquant scales, at one-device causal lengths.
    refuse_static_scale("cp::gqa_paged_attention_quant", k_static_scale, v_static_scale)
    refuse_fp8("cp::gqa_paged_attention_quant", k_cache, v_cache)
    k_cache, k_scale_cache = quant_scatter_into(k_cache, k_scale_cache, k, slot_mapping)
    v_cache, v_scale_cache = quant_scatter_into(v_cache, v_scale_cache, v, slot_mapping)
    return _gqa_after_write(q, k_cache, v_cache, block_table, seq_lens, query_start_loc, scale, k_scale_cache,
                            v_scale_cache)


def convert_mla_attention(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                          slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                          scale: float, meta_outputs: Any = None):
    latent = ge.ConcatV2([kv_c, k_pe], const(1, I32), N=2)
    written = scatter_into(kv_cache, latent, slot_mapping)
    written.set_meta(kv_cache.meta)
    out, _ = mla_partial(q_nope, q_pe, written, block_table, query_start_loc,
                         causal_lens(query_start_loc, seq_lens, q_nope), scale)
    return out


def convert_mla_attention_quant(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                                kv_scale_cache: Tensor, slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor,
                                query_start_loc: Tensor, scale: float, kv_static_scale: Any = None,
                                meta_outputs: Any = None):
    # One scale per token for the whole [c | k_pe] row, as the reference's write_latent.
    refuse_static_scale("cp::mla_attention_quant", kv_static_scale)
    refuse_fp8("cp::mla_attention_quant", kv_cache)
    latent = ge.ConcatV2([kv_c, k_pe], const(1, I32), N=2)  # [T, L+R]
    written, scales = quant_scatter_into(kv_cache, kv_scale_cache, latent, slot_mapping)
    out, _ = mla_partial(q_nope, q_pe, written, block_table, query_start_loc,
                         causal_lens(query_start_loc, seq_lens, q_nope), scale, scales)
    return out
