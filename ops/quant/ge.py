"""GE converters: the W8A8 linears (ops/quant/ops.py).

Both quantise the activations per input group with GE primitives, multiply int8 x
int8 -> int32 with `QuantBatchMatmulV3` (the op behind `npu_quant_matmul`, here with
an int32 output so the accumulators stay integer, one batch per group:
x_q [G, T, k] x W [G, k, out]), then dequantise in fp32 and sum the groups:

- `cp::w8a8_dynamic_linear`: per-token, per-group scale amax / 127 (`ReduceMaxD`,
  `Div`, `Round`, `ClipByValue`, `Cast` to int8), weight offset subtracted as
  o_w * sum_k x_q in int32, y = sum_g acc_g * s_x * s_w.
- `cp::w8a8_static_linear`: x / s_g + o_g rounded and clipped to int8,
  y = sum_g (acc_g + quant_bias_g) * deq_scale_g.

With one group (a TP rank's shard) this is npu_dynamic_quant + npu_quant_matmul
with an fp32 dequantisation after it; the fused per-token dequant of
QuantBatchMatmulV3 (`pertoken_scale`, bf16 output) would round the output once more
than the reference, so the int32 form is kept. Not run on an NPU: the GE graph is
checked by `tools/ge_check.py`, structure and, evaluated on CPU by tools/ge_eval, value.
"""

from __future__ import annotations

from typing import Any

from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import DataType, Tensor

from cp_compile.ops.core.ge_util import F32, I32, I64, cast, const, dims, ge_dtype, reshape, where

I8 = DataType.DT_INT8


def _groups_first(x: Tensor) -> Tensor:
    """[T, G, d] -> [G, T, d]."""
    return ge.Transpose(x, const([1, 0, 2], I64))


def _int8_matmul(x_q: Tensor, weight: Tensor, groups: int, k: int, out: int) -> Tensor:
    """x_q int8 [G, T, k], weight int8 [G * k, out] -> int32 [G, T, out]."""
    return ge.QuantBatchMatmulV3(x_q, reshape(weight, [groups, k, out]), const([1.0], F32), offset=None, bias=None,
                                 pertoken_scale=None, dtype=I32, transpose_x1=False, transpose_x2=False)


def convert_w8a8_dynamic_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, weight_offset: Tensor, groups: int,
                                meta_outputs: Any = None):
    T, n = dims(x)
    k, out = int(n) // groups, int(dims(weight)[1])
    xg = reshape(cast(x, F32), [T, groups, k])  # [T, G, k]
    amax = ge.ReduceMaxD(ge.Abs(xg), axes=[2], keep_dims=True)  # [T, G, 1]
    scale = where(ge.Greater(amax, const(0.0, F32)), ge.Div(amax, const(127.0, F32)), const(1.0, F32))
    q = ge.ClipByValue(ge.Round(ge.Div(xg, scale)), const(-127.0, F32), const(127.0, F32))
    x_q = _groups_first(cast(q, I8))  # [G, T, k] int8
    acc = _int8_matmul(x_q, weight, groups, k, out)  # [G, T, out] int32
    rowsum = ge.ReduceSumD(cast(x_q, I32), axes=[2], keep_dims=True)  # [G, T, 1]
    acc = ge.Sub(acc, ge.Mul(rowsum, reshape(cast(weight_offset, I32), [1, 1, out])))
    terms = ge.Mul(ge.Mul(cast(acc, F32), _groups_first(scale)), reshape(cast(weight_scale, F32), [1, 1, out]))
    return cast(ge.ReduceSumD(terms, axes=[0], keep_dims=False), ge_dtype(x.meta.dtype))  # [T, out]


def convert_w8a8_static_linear(x: Tensor, weight: Tensor, input_scale: Tensor, input_offset: Tensor,
                               quant_bias: Tensor, deq_scale: Tensor, meta_outputs: Any = None):
    T, n = dims(x)
    groups = int(input_scale.meta.shape[0])
    k, out = int(n) // groups, int(dims(weight)[1])
    xg = reshape(cast(x, F32), [T, groups, k])  # [T, G, k]
    s = reshape(cast(input_scale, F32), [1, groups, 1])
    o = reshape(cast(input_offset, F32), [1, groups, 1])
    q = ge.ClipByValue(ge.Add(ge.Round(ge.Div(xg, s)), o), const(-128.0, F32), const(127.0, F32))
    acc = _int8_matmul(_groups_first(cast(q, I8)), weight, groups, k, out)  # [G, T, out] int32
    acc = ge.Add(acc, reshape(cast(quant_bias, I32), [groups, 1, out]))
    terms = ge.Mul(cast(acc, F32), reshape(cast(deq_scale, F32), [groups, 1, out]))
    return cast(ge.ReduceSumD(terms, axes=[0], keep_dims=False), ge_dtype(x.meta.dtype))  # [T, out]
