"""GE helpers of the quantised KV cache (issue 39, decision 70): the write's quantisation as GE
primitives, and the scatter of codes and scales (imported only when torchair is).

`core/kv_quant.quantize` in GE ops, the same fp32 operations in the same order, so the codes
are the reference's bit for bit (the GE check compares the caches exactly):

    amax  = ReduceMaxD(Abs(Cast(x, fp32)), last axis)                       # [rows]
    scale = SelectV2(Greater(amax, 0), RealDiv(amax, 127), 1)                 # all-zero row: 1
    codes = Cast(ClipByValue(Round(RealDiv(x, scale)), -127, 127), int8)      # Round: half to even

GE's Round is TF's (half to even, as torch.round; the Ascend IR says "Compatible with
TensorFlow"); the evaluator runs torch.round. Only int8: FusedInferAttentionScore reads
int8 pages with antiquant scales and has no fp8 key / value input (ops/paged/ge.py), so an
fp8 cache is refused by the converters before anything is built.
"""

from __future__ import annotations

from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import DataType, Tensor

from cp_compile.ops.core.ge_util import F32, cast, const, dims, reshape, scatter_into, where

I8 = DataType.DT_INT8
INT8_QMAX = 127.0  # core/kv_quant.QMAX[torch.int8]


def quantize_int8(x: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """x [..., D] of `rank` dims (any float; a GE op's output may carry no meta, hence the rank)
    -> (codes [..., D] int8, scale [...] fp32): one scale per row."""
    xf = cast(x, F32)
    last = rank - 1
    amax = ge.ReduceMaxD(ge.Abs(xf), axes=[last], keep_dims=False)  # [...]
    scale = where(ge.Greater(amax, const(0.0, F32)), ge.RealDiv(amax, const(INT8_QMAX, F32)), const(1.0, F32))
    y = ge.RealDiv(xf, ge.Unsqueeze(scale, axes=[last]))
    codes = ge.Cast(ge.ClipByValue(ge.Round(y), const(-INT8_QMAX, F32), const(INT8_QMAX, F32)), dst_type=I8)
    return codes, scale


def quant_scatter_into(cache: Tensor, scale_cache: Tensor, new: Tensor, slot_mapping: Tensor) -> tuple[Tensor, Tensor]:
    """core/kv_quant.write_quantized in GE: new [T, ...row dims, D] quantised per row, its codes
    into cache [NB, BS, ...row dims, D] and its scales into scale_cache [NB, BS, rows] at each
    token's slot (slot -1: the scratch block, as every GE cache write). Returns the written
    cache and scale cache (ScatterNdUpdate's ref outputs, with the inputs' meta)."""
    codes, scale = quantize_int8(new, len(cache.meta.shape) - 1)  # [T, ..., D], [T, ...]
    rows = int(scale_cache.meta.shape[2])
    scale = reshape(scale, [dims(slot_mapping)[0], rows])  # [T, rows]: GQA rows = KV heads, MLA 1
    written = scatter_into(cache, codes, slot_mapping)
    scales = scatter_into(scale_cache, scale, slot_mapping)
    written.set_meta(cache.meta)
    scales.set_meta(scale_cache.meta)
    return written, scales
