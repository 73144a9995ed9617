"""`cp::mla_preprocess` (MLAPO): everything of an MLA layer before attention, one op.

    q_resid      = rms_norm(q_a_proj(x))                    (q-LoRA; without it q_proj(x) below)
    q_nope, q_pe = split(q_b_proj(q_resid).view(T, H, nope + R))
    kv_c, k_pe   = split(kv_a_proj_with_mqa(x), [L, R]);  kv_c = rms_norm(kv_c)
    q_pe, k_pe   = rope(q_pe), rope(k_pe)
    q_abs        = einsum(q_nope, W_UK)                      [T, H, L]  (W_UK absorbed)
    kv_cache[slot_mapping] = [kv_c | k_pe]                   (when a cache is given)

-> (q_abs [T, H, L], q_pe [T, H, R], kv_c [T, L], k_pe [T, R], q_resid [T, q_lora] or [T, 0]):
exactly the inputs of `cp::mla_attention` / `cp::sparse_mla_attention` (and, for
DeepSeek-V3.2, q_resid for the indexer). The three linears are float or W8A8
dynamic (int8 weight: pass its scale and offset). The `mla_preprocess` pass
(passes/mla_preprocess.py) puts it in place of the unfused subgraph; the cache
write is folded in where the graph writes the latent of exactly these tokens
(DCP / SFA DCP / DSA-CP: the local write; one device: the attention's own write).

Kernels (this folder): the torch reference (`reference.py`, every device's oracle),
the CPU kernel (`cpu.py`: the same values without the reference's copies), the Triton
kernel for the norm + rope + cache-write tail on CUDA (`triton_tail.py`, the GEMMs
stay library GEMMs), torch_npu's fused MLA prolog on the NPU (`npu.py`, untested),
and the GE converter (`ge.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cp_compile.ops.core import kv_quant, paged_cache
from cp_compile.ops.core.spec import GE, Absent, OpDecl
from cp_compile.ops.mla_preprocess import launch
from cp_compile.ops.mla_preprocess import reference as ref
from cp_compile.ops.mla_preprocess.cpu import mla_preprocess_cpu
from cp_compile.ops.mla_preprocess.npu import mla_preprocess_npu

ROPE_MODES = ref.ROPE_MODES


def check_args(x: Tensor, q_a_weight: Tensor | None, q_a_norm: Tensor | None, q_b_weight: Tensor,
               kv_a_weight: Tensor, kv_norm: Tensor, w_uk: Tensor, cos: Tensor, kv_cache: Tensor | None,
               slot_mapping: Tensor | None, rope_mode: str) -> None:
    """Refuse, before anything is written, arguments that do not describe one MLA layer."""
    if rope_mode not in ROPE_MODES:
        raise ValueError(f"mla_preprocess: rope_mode={rope_mode!r}; use one of {ROPE_MODES}")
    if (q_a_weight is None) != (q_a_norm is None):
        raise ValueError("mla_preprocess: q_a_weight and q_a_norm come together (q-LoRA) or not at all (q_proj)")
    if x.dim() != 2 or w_uk.dim() != 3 or cos.dim() != 2:
        raise ValueError(f"mla_preprocess: x [T, D], w_uk [H, nope, L], cos [T, R/2]; got x {tuple(x.shape)}, "
                         f"w_uk {tuple(w_uk.shape)}, cos {tuple(cos.shape)}")
    L = w_uk.shape[-1]
    if kv_norm.shape != (L,):
        raise ValueError(f"mla_preprocess: kv_norm [L = {L}] (W_UK's latent dim), got {tuple(kv_norm.shape)}")
    kv_out = kv_a_weight.shape[-1] if kv_a_weight.dtype == torch.int8 else kv_a_weight.shape[0]
    if kv_out != L + 2 * cos.shape[-1]:
        raise ValueError(f"mla_preprocess: kv_a_proj gives {kv_out} = L + R columns, but L = {L} and cos gives "
                         f"R = {2 * cos.shape[-1]}")
    if (kv_cache is None) != (slot_mapping is None):
        raise ValueError("mla_preprocess: kv_cache and slot_mapping come together (cache write) or not at all")
    if kv_cache is not None and kv_cache.shape[-1] != kv_out:
        raise ValueError(f"mla_preprocess: kv_cache rows hold L + R = {kv_out} values, got {kv_cache.shape[-1]}")


@torch.library.custom_op("cp::mla_preprocess", mutates_args=("kv_cache",))
def mla_preprocess(
    x: Tensor,  # [T, D]
    q_a_weight: Tensor | None,  # [q_lora, D] float | int8 [D, q_lora]; None without q-LoRA
    q_a_scale: Tensor | None,  # W8A8: fp32 [q_lora]
    q_a_offset: Tensor | None,  # W8A8: int32 [q_lora]
    q_a_norm: Tensor | None,  # [q_lora]
    q_b_weight: Tensor,  # [H * (nope + R), q_lora | D] float | int8 transposed
    q_b_scale: Tensor | None,
    q_b_offset: Tensor | None,
    kv_a_weight: Tensor,  # [L + R, D] float | int8 [D, L + R]
    kv_a_scale: Tensor | None,
    kv_a_offset: Tensor | None,
    kv_norm: Tensor,  # [L]
    w_uk: Tensor,  # [H, nope, L]
    cos: Tensor,  # [T, R/2] fp32
    sin: Tensor,  # [T, R/2] fp32
    kv_cache: Tensor | None,  # [NB, BS, L + R] written in place
    slot_mapping: Tensor | None,  # [T] int64, -1 = skip
    q_eps: float,
    kv_eps: float,
    rope_mode: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """MLA pre-processing -> (q_abs, q_pe, kv_c, k_pe, q_resid); see the module doc."""
    check_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache, slot_mapping,
               rope_mode)
    return ref.mla_preprocess(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                              kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache,
                              slot_mapping, q_eps, kv_eps, rope_mode)


def _mla_preprocess_cpu(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                        kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache, slot_mapping,
                        q_eps, kv_eps, rope_mode):
    """The CPU kernel (ops/mla_preprocess/cpu.py: the body's values without its copies), checked as the body."""
    check_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache, slot_mapping,
               rope_mode)
    return mla_preprocess_cpu(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                              kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache,
                              slot_mapping, q_eps, kv_eps, rope_mode)


def _out_features(weight: Tensor) -> int:
    return weight.shape[-1] if weight.dtype == torch.int8 else weight.shape[0]


@mla_preprocess.register_fake
def _mla_preprocess_fake(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                         kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache, slot_mapping,
                         q_eps, kv_eps, rope_mode):
    T = x.shape[0]
    H, _, L = w_uk.shape
    R = 2 * cos.shape[-1]
    q_lora = 0 if q_a_weight is None else _out_features(q_a_weight)
    return (x.new_empty(T, H, L), x.new_empty(T, H, R), x.new_empty(T, L), x.new_empty(T, R),
            x.new_empty(T, q_lora))


# A quantised latent cache (CPConfig.kv_cache_dtype int8 / fp8, issue 39): its own op, whose scale
# cache is a required mutated argument (an optional mutated argument breaks torchair's GE
# conversion of every graph, docs/quant_kv.md). The latent [kv_c | k_pe] is written exactly as
# `cp::quant_cache_write` writes it: codes, and one fp32 scale per token in kv_scale_cache.
@torch.library.custom_op("cp::mla_preprocess_quant", mutates_args=("kv_cache", "kv_scale_cache"))
def mla_preprocess_quant(
    x: Tensor,  # [T, D]
    q_a_weight: Tensor | None,
    q_a_scale: Tensor | None,
    q_a_offset: Tensor | None,
    q_a_norm: Tensor | None,
    q_b_weight: Tensor,
    q_b_scale: Tensor | None,
    q_b_offset: Tensor | None,
    kv_a_weight: Tensor,
    kv_a_scale: Tensor | None,
    kv_a_offset: Tensor | None,
    kv_norm: Tensor,  # [L]
    w_uk: Tensor,  # [H, nope, L]
    cos: Tensor,  # [T, R/2] fp32
    sin: Tensor,  # [T, R/2] fp32
    kv_cache: Tensor,  # [NB, BS, L + R] int8 / float8_e4m3fn, written in place
    kv_scale_cache: Tensor,  # [NB, BS, 1] fp32, written in place
    slot_mapping: Tensor,  # [T] int64, -1 = skip
    q_eps: float,
    kv_eps: float,
    rope_mode: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """`cp::mla_preprocess` writing its latent into a quantised cache (arguments as that op's, the
    scale cache after the cache)."""
    check_quant_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache, kv_scale_cache,
                     slot_mapping, rope_mode)
    return ref.mla_preprocess(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                              kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache,
                              slot_mapping, q_eps, kv_eps, rope_mode,
                              write=lambda cache, new, slots: paged_cache.write_cache(cache, new, slots,
                                                                                      kv_scale_cache))


def check_quant_args(x: Tensor, q_a_weight: Tensor | None, q_a_norm: Tensor | None, q_b_weight: Tensor,
                     kv_a_weight: Tensor, kv_norm: Tensor, w_uk: Tensor, cos: Tensor, kv_cache: Tensor,
                     kv_scale_cache: Tensor, slot_mapping: Tensor, rope_mode: str) -> None:
    """`check_args`, and a quantised cache with its scale cache (one fp32 scale per token)."""
    check_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache, slot_mapping,
               rope_mode)
    if not kv_quant.is_quantized(kv_cache.dtype):
        raise ValueError(f"mla_preprocess_quant: kv_cache is {kv_cache.dtype}; it writes an int8 / float8_e4m3fn "
                         "cache (use cp::mla_preprocess for a cache in the model's dtype)")
    kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")
    kv_quant.scale_view(kv_cache, kv_scale_cache)  # refuses a scale cache of the wrong shape / dtype


def _mla_preprocess_quant_cpu(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                              kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache,
                              kv_scale_cache, slot_mapping, q_eps, kv_eps, rope_mode):
    """The CPU kernel's values, then the latent quantised into the cache as cp::quant_cache_write's CPU body."""
    check_quant_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache, kv_scale_cache,
                     slot_mapping, rope_mode)
    out = mla_preprocess_cpu(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                             kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, None, None, q_eps, kv_eps,
                             rope_mode)
    paged_cache.write_cache(kv_cache, torch.cat([out[2], out[3]], dim=-1), slot_mapping, kv_scale_cache)
    return out


@mla_preprocess_quant.register_fake
def _mla_preprocess_quant_fake(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                               kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache,
                               kv_scale_cache, slot_mapping, q_eps, kv_eps, rope_mode):
    return _mla_preprocess_fake(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                                kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, None, None, q_eps,
                                kv_eps, rope_mode)


# The quantised-KV ops are not built for the NPU / GE yet (docs/quant_kv.md), this one with them.
_NO_QUANT = ("not built: a quantised KV cache (issue 39) runs on CPU / CUDA; torch_npu's MLA prolog and the GE "
             "graph write the latent in the model's dtype")

# ----------------------------------------------------------------------------- declarations (core/spec.py)
OPS = (
    OpDecl(mla_preprocess, cuda=launch.mla_preprocess, npu=mla_preprocess_npu,
           ge=GE("ge", "MatMulV2", "Rsqrt", "BatchMatMulV2", "ScatterNdUpdate"), profile="other",
           cpu=_mla_preprocess_cpu),
    OpDecl(mla_preprocess_quant, cuda=launch.mla_preprocess_quant, npu=Absent(_NO_QUANT), ge=Absent(_NO_QUANT),
           profile="other", cpu=_mla_preprocess_quant_cpu),
)
