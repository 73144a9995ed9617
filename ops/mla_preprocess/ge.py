"""GE converter: `cp::mla_preprocess` (MLAPO, ops/mla_preprocess/ops.py) from GE primitives.

CANN has a fused MLA prolog (`aclnnMlaProlog` / `MlaPrologV2` / V3, torch_npu's
`npu_mla_prolog[_v2|_v3]`): x -> W^DQ -> RmsNorm -> W^UQ, W^UK (q^N) and W^QR + rope
(q^R); x -> W^DKV -> RmsNorm -> cache (k^C) and W^KR + rope -> another cache (k^R)
(torch_npu docs: https://www.hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000883.html,
aclnnMlaProlog: https://www.hiascend.com/document/detail/zh/CANNCommunityEdition/83RC1alpha001/API/aolapi/context/aclnnMlaProlog.md,
MlaPrologV2: https://gitcode.com/Ascend/op-plugin/blob/7.3.0/docs/context/torch_npu-npu_mla_prolog_v2.md).
Its semantics do not fit this op's, so the converter is built from primitives:

- two caches (k^C [.., Hckv], k^R [.., Dr]); this project's latent cache holds
  [kv_c | k_pe] in one row of L + R (what FusedInferAttentionScore reads here);
- q-LoRA is required (W^DQ); DeepSeek-V2-Lite-style q_proj has none;
- fixed shapes (He = 7168, Hcq = 1536, Hckv = 512, D = 128, Dr = 64, N in
  {32, 64, 128}, BlockSize 16 / 128): the tiny test models and TP shards outside
  that set would not run;
- its rope is the half-split form; the models' interleaved layouts need the
  weights' rope columns permuted at load (vLLM-Ascend does this) — a weight
  re-layout the graph rewrite cannot do on a parameter it does not own.

The NPU eager kernel (ops/mla_preprocess/npu.py) does call `npu_mla_prolog_v3`
where the shapes fit and the cache is split. Here: MatMulV2 (float linears; the
W8A8 ones reuse the W8A8 converter), RMSNorm as Cast / Mul / ReduceMeanD / Add /
Rsqrt, rope by GatherV2 of the pair halves and one GatherV2 to the output layout,
the absorption as BatchMatMulV2 per head, the cache write as ScatterNdUpdate.
Structure checked by `tools/ge_check.py`; numbers only by the torch reference.
"""

from __future__ import annotations

from typing import Any


from torchair._ge_concrete_graph import ge_apis as ge
from torchair.ge._ge_graph import Tensor

from cp_compile.ops.core.ge_util import F32, I64, cast, const, dims, ge_dtype, reshape
from cp_compile.ops.core.ge_util import scatter_into
from cp_compile.ops.quant.ge import convert_w8a8_dynamic_linear


def _linear(x: Tensor, weight: Tensor, scale: Tensor | None, offset: Tensor | None) -> Tensor:
    if scale is not None:  # int8 K-major weight: the W8A8 dynamic linear, one group
        return convert_w8a8_dynamic_linear(x, weight, scale, offset, 1)
    return ge.MatMulV2(x, weight, None, None, transpose_x1=False, transpose_x2=True)


def _rms_norm(x: Tensor, weight: Tensor, eps: float, dtype: int) -> Tensor:
    xf = cast(x, F32)
    var = ge.ReduceMeanD(ge.Mul(xf, xf), axes=[-1], keep_dims=True)
    return ge.Mul(weight, cast(ge.Mul(xf, ge.Rsqrt(ge.Add(var, const(eps, F32)))), dtype))


def _cols(x: Tensor, idx: list[int]) -> Tensor:
    return ge.GatherV2(x, const(idx, I64), const(-1, I64))


def _rope(x: Tensor, cos: Tensor, sin: Tensor, R: int, mode: str, dtype: int, unsqueeze: bool) -> Tensor:
    """x [T, (H,) R], cos / sin [T, R/2] -> rotated, in the `mode` layout (mla_preprocess_reference.rope)."""
    half = R // 2
    out_dtype = dtype
    if mode == "interleave_fp32":  # HF DeepSeek-V2: rotate in fp32, cast back (mla_preprocess_reference.rope)
        x, dtype, mode = cast(x, F32), F32, "interleave"
    c, s = cast(cos, dtype), cast(sin, dtype)
    if unsqueeze:
        c, s = ge.Unsqueeze(c, axes=[1]), ge.Unsqueeze(s, axes=[1])  # [T, 1, R/2]
    first, second = (list(range(half)), list(range(half, R))) if mode == "neox" else \
        (list(range(0, R, 2)), list(range(1, R, 2)))
    x1, x2 = _cols(x, first), _cols(x, second)
    rot = ge.ConcatV2([ge.Sub(ge.Mul(x1, c), ge.Mul(x2, s)), ge.Add(ge.Mul(x2, c), ge.Mul(x1, s))],
                      const(-1, I64), N=2)  # [rotated firsts | rotated seconds]
    if mode == "interleave":  # back to pairs (2i, 2i+1)
        rot = _cols(rot, [j for i in range(half) for j in (i, half + i)])
    return cast(rot, out_dtype)


def convert_mla_preprocess(x: Tensor, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale,
                           q_b_offset, kv_a_weight, kv_a_scale, kv_a_offset, kv_norm: Tensor, w_uk: Tensor,
                           cos: Tensor, sin: Tensor, kv_cache, slot_mapping, q_eps: float, kv_eps: float,
                           rope_mode: str, meta_outputs: Any = None):
    dtype = ge_dtype(x.meta.dtype)
    T = dims(x)[0]
    H, nope, L = (int(d) for d in w_uk.meta.shape)
    R = 2 * int(cos.meta.shape[-1])
    if q_a_weight is not None:
        q_resid = _rms_norm(_linear(x, q_a_weight, q_a_scale, q_a_offset), q_a_norm, q_eps, dtype)
        q = _linear(q_resid, q_b_weight, q_b_scale, q_b_offset)
    else:
        q_resid = reshape(_cols(x, []), [T, 0])
        q = _linear(x, q_b_weight, q_b_scale, q_b_offset)
    q = reshape(q, [T, H, nope + R])
    q_nope, q_pe = _cols(q, list(range(nope))), _cols(q, list(range(nope, nope + R)))
    kv = _linear(x, kv_a_weight, kv_a_scale, kv_a_offset)  # [T, L + R]
    kv_c = _rms_norm(_cols(kv, list(range(L))), kv_norm, kv_eps, dtype)
    k_pe = _rope(_cols(kv, list(range(L, L + R))), cos, sin, R, rope_mode, dtype, unsqueeze=False)
    q_pe = _rope(q_pe, cos, sin, R, rope_mode, dtype, unsqueeze=True)
    perm = const([1, 0, 2], I64)
    q_abs = ge.Transpose(ge.BatchMatMulV2(ge.Transpose(q_nope, perm), w_uk, None, None), perm)  # [T, H, L]
    if kv_cache is not None:
        scatter_into(kv_cache, ge.ConcatV2([kv_c, k_pe], const(-1, I64), N=2), slot_mapping)
    return q_abs, q_pe, kv_c, k_pe, q_resid
