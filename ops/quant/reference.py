"""Torch references of the W8A8 linears (`ops/quant/ops.py`): int8 x int8 -> int32, exactly.

Layouts follow the NPU quantised matmul (`npu_quant_matmul` / QuantBatchMatmulV3):
the int8 weight is stored K-major, [in, out], so a row-parallel (input-sharded)
weight is split along dim 0 and a TP all-gather along dim 0 rebuilds the full one
with no transposed copy.

Activation quantisation works on `groups` equal slices of the input dim. A TP rank
quantises its own input shard, i.e. one group; the same weights gathered to full
size and run with groups = tp quantise each shard's slice of a token exactly as
that shard's rank did, so every group's int32 accumulator is bit-identical to the
rank's (docs/dsa_cp.md, "o_proj path"). Quantising the full row with one scale
(groups = 1 on the full weight) is a different, coarser quantisation.

Everything here is integer arithmetic up to the int32 accumulators; the only float
steps are the per-group dequantisation (acc * scale products) and the sum over
groups, done in fp32 in group order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

QMAX = 127  # symmetric int8: [-127, 127] (keeps -x representable)


def check_linear(x: Tensor, weight: Tensor, groups: int) -> None:
    """Refuse operands the W8A8 linears cannot take (shape / dtype / group split)."""
    if weight.dtype != torch.int8 or weight.dim() != 2 or x.dim() != 2 or x.shape[1] != weight.shape[0]:
        raise ValueError(f"w8a8 linear: x [T, in] float and weight int8 [in, out], got x {tuple(x.shape)} "
                         f"and weight {weight.dtype} {tuple(weight.shape)}")
    if groups < 1 or weight.shape[0] % groups:
        raise ValueError(f"w8a8 linear: in={weight.shape[0]} does not split into groups={groups}")


def int8_matmul(a: Tensor, b: Tensor) -> Tensor:
    """a int8 [..., M, K] @ b int8 [..., K, N] -> int32 [..., M, N], exact (|acc| < 2^31 for K < 133k)."""
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul: int8 operands, got {a.dtype} and {b.dtype}")
    return torch.matmul(a.to(torch.int32), b.to(torch.int32))


def quantize_per_token(x: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """Dynamic symmetric per-token quantisation of each of `groups` input slices.

    x [T, in] float -> (x_q int8 [T, G, in/G], scale fp32 [T, G]); an all-zero slice
    gets scale 1 (its codes are 0 either way).
    """
    T, n = x.shape
    xg = x.float().reshape(T, groups, n // groups)  # [T, G, k]
    amax = xg.abs().amax(dim=-1)  # [T, G]
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    x_q = torch.clamp(torch.round(xg / scale[..., None]), -QMAX, QMAX).to(torch.int8)
    return x_q, scale


def quantize_static(x: Tensor, input_scale: Tensor, input_offset: Tensor) -> Tensor:
    """Static (calibrated) quantisation, one scale / offset per input group.

    x [T, in] float, input_scale fp32 [G], input_offset int32 [G] -> int8 [T, G, in/G]
    with q = clamp(round(x / s_g) + o_g, -128, 127).
    """
    T, n = x.shape
    G = input_scale.shape[0]
    xg = x.float().reshape(T, G, n // G)
    q = torch.round(xg / input_scale.float()[None, :, None]) + input_offset.float()[None, :, None]
    return torch.clamp(q, -128, 127).to(torch.int8)


Int8Matmul = Callable[[Tensor, Tensor], Tensor]  # int8 [G, M, K] @ int8 [G, K, N] -> int32 [G, M, N]


def _grouped_acc(x_q: Tensor, weight: Tensor, matmul: Int8Matmul = int8_matmul) -> Tensor:
    """x_q int8 [T, G, k], weight int8 [G * k, out] -> int32 [G, T, out] (one accumulator per group).
    `matmul`: the int8 GEMM (a device kernel passes its own; integer, so any exact one gives the same)."""
    T, G, k = x_q.shape
    return matmul(x_q.transpose(0, 1), weight.reshape(G, k, weight.shape[-1]))


def _sum_groups(terms: Tensor) -> Tensor:
    """fp32 [G, T, out] -> [T, out], summed in group order (0 + t_0 + t_1 + ...)."""
    out = terms[0]
    for g in range(1, terms.shape[0]):
        out = out + terms[g]
    return out


def w8a8_dynamic_accumulators(x: Tensor, weight: Tensor, weight_offset: Tensor, groups: int,
                              matmul: Int8Matmul = int8_matmul) -> tuple[Tensor, Tensor]:
    """(int32 accumulators [G, T, out] with the weight offset applied, activation scales [T, G])."""
    x_q, scale = quantize_per_token(x, groups)
    acc = _grouped_acc(x_q, weight, matmul)  # [G, T, out]
    # w = s_w * (w_q - o_w): subtract o_w * sum_k x_q per token and group, in int32.
    rowsum = x_q.to(torch.int32).sum(dim=-1, dtype=torch.int32).transpose(0, 1)  # [G, T]
    acc = acc - rowsum[..., None] * weight_offset.to(torch.int32)[None, None, :]
    return acc, scale


def w8a8_dynamic_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, weight_offset: Tensor,
                        groups: int, matmul: Int8Matmul = int8_matmul) -> Tensor:
    """y [T, out] = sum_g acc_g * s_x[t, g] * s_w[o], in x's dtype (fp32 inside)."""
    acc, scale = w8a8_dynamic_accumulators(x, weight, weight_offset, groups, matmul)
    terms = acc.float() * scale.transpose(0, 1)[..., None] * weight_scale.float()[None, None, :]
    return _sum_groups(terms).to(x.dtype)


def w8a8_static_accumulators(x: Tensor, weight: Tensor, input_scale: Tensor, input_offset: Tensor,
                             quant_bias: Tensor, matmul: Int8Matmul = int8_matmul) -> Tensor:
    """int32 accumulators [G, T, out] including each group's quant bias."""
    acc = _grouped_acc(quantize_static(x, input_scale, input_offset), weight, matmul)
    return acc + quant_bias.to(torch.int32)[:, None]


def w8a8_static_linear(x: Tensor, weight: Tensor, input_scale: Tensor, input_offset: Tensor, quant_bias: Tensor,
                       deq_scale: Tensor, matmul: Int8Matmul = int8_matmul) -> Tensor:
    """y [T, out] = sum_g (acc_g + quant_bias_g) * deq_scale_g, in x's dtype (fp32 inside)."""
    acc = w8a8_static_accumulators(x, weight, input_scale, input_offset, quant_bias, matmul)
    return _sum_groups(acc.float() * deq_scale.float()[:, None, :]).to(x.dtype)
