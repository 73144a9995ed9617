"""W8A8 linears as custom ops: the quantised o_proj (and any row-parallel linear).

Two ops, one per activation-quantisation scheme, with the NPU's K-major int8 weight
[in, out] (what `npu_quant_matmul` / QuantBatchMatmulV3 take):

- `cp::w8a8_dynamic_linear(x, weight, weight_scale, weight_offset, groups)`:
  per-token activation quantisation over `groups` equal input slices (a TP rank:
  groups = 1 over its shard; the DSA-CP full-weight o_proj: groups = tp), int8
  weight with per-output-channel scale / offset.
- `cp::w8a8_static_linear(x, weight, input_scale, input_offset, quant_bias, deq_scale)`:
  calibrated activation scale / offset per input group ([G]), int32 quant bias and
  fp32 dequant scale per group and output channel ([G, out]); G = 1 on a TP rank,
  G = tp after the full-weight gather.

A single op node per quantised linear gives the passes a clean pattern (the weight
placeholder is an argument of the node) and the lowering one place to emit the NPU
quantised matmul (`quant/ge.py`). Torch references: `quant/reference.py`
(int32 accumulation, exact).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cp_compile.ops.core.spec import GE, TRITON_ASCEND, OpDecl
from cp_compile.ops.quant import launch
from cp_compile.ops.quant import reference as ref


@torch.library.custom_op("cp::w8a8_dynamic_linear", mutates_args=())
def w8a8_dynamic_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, weight_offset: Tensor,
                        groups: int) -> Tensor:
    """x [T, in] (bf16 / fp16 / fp32), weight int8 [in, out], weight_scale fp32 [out],
    weight_offset int32 [out] -> [T, out] in x's dtype.

    Each token's `groups` input slices are quantised separately (symmetric, per
    token), multiplied in int8 with int32 accumulation, dequantised with
    s_x[t, g] * s_w[o] and summed over groups in fp32.
    """
    ref.check_linear(x, weight, groups)
    return ref.w8a8_dynamic_linear(x, weight, weight_scale, weight_offset, groups)


@w8a8_dynamic_linear.register_fake
def _(x, weight, weight_scale, weight_offset, groups):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op("cp::w8a8_static_linear", mutates_args=())
def w8a8_static_linear(x: Tensor, weight: Tensor, input_scale: Tensor, input_offset: Tensor, quant_bias: Tensor,
                       deq_scale: Tensor) -> Tensor:
    """x [T, in], weight int8 [in, out], input_scale fp32 [G], input_offset int32 [G],
    quant_bias int32 [G, out], deq_scale fp32 [G, out] -> [T, out] in x's dtype.

    Group g (input columns [g * in/G, (g+1) * in/G)) is quantised with its own
    calibrated scale and offset; y = sum_g (acc_g + quant_bias_g) * deq_scale_g.
    """
    ref.check_linear(x, weight, input_scale.shape[0])
    return ref.w8a8_static_linear(x, weight, input_scale, input_offset, quant_bias, deq_scale)


@w8a8_static_linear.register_fake
def _(x, weight, input_scale, input_offset, quant_bias, deq_scale):
    return x.new_empty((x.shape[0], weight.shape[1]))


QUANT_LINEAR_OPS = (torch.ops.cp.w8a8_dynamic_linear, torch.ops.cp.w8a8_static_linear)


# ----------------------------------------------------------------------------- declarations (core/spec.py)
# Every piece of every op above: kernels per device, GE converter, profile bucket.
OPS = (
    OpDecl(w8a8_dynamic_linear, cuda=launch.w8a8_dynamic_linear, npu=TRITON_ASCEND,
           ge=GE("ge", "ReduceMaxD", "Round", "QuantBatchMatmulV3", "ReduceSumD"), profile="other"),
    OpDecl(w8a8_static_linear, cuda=launch.w8a8_static_linear, npu=TRITON_ASCEND,
           ge=GE("ge", "Round", "QuantBatchMatmulV3", "ReduceSumD"), profile="other"),
)
