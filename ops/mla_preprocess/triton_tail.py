"""MLAPO tail: kv_a_layernorm + rope on k_pe and q_pe + the latent cache write, one kernel.

A quantised latent cache (int8 / fp8, issue 39) is written by `_mla_tail_quant_kernel` (the
same body, `QUANT`): the row [kv_c | k_pe] as codes with one fp32 scale per token, the
arithmetic of core's `_cache_write_quant_kernel` (so the bytes `cp::quant_cache_write` writes).

After the library GEMMs of `cp::mla_preprocess` (kv_a_proj_with_mqa -> kv [T, L + R],
q_b_proj -> q [T, H, nope + R]) one program per token (persistent grid):

    kv_c = w * (kv[:L] * rsqrt(mean(kv[:L]^2) + eps))   (fp32 statistics, cast like the reference)
    k_pe = rope(kv[L:]),  q_pe[h] = rope(q[h, nope:])   (one cos / sin row per token)
    cache[slot] = [kv_c | k_pe]                          (slot -1: nothing written)

so the normed latent and the rotated keys are written once, where the unfused graph
writes kv_c, k_pe, their concatenation and the cache row. Rope layouts
(`mla_preprocess_reference.rope`): pairs (2i, 2i+1) or halves (i, i + R/2) in,
interleaved or split out; rotated in the activation dtype, or in fp32 (`interleave_fp32`).
Torch oracle: `mla_preprocess_reference` (norm sum order
differs: tolerance, not bits).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.mla_preprocess import ops as mla
from cp_compile.ops.mla_preprocess import reference as ref
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    require_int32_offsets,
)
from cp_compile.ops.core import kv_quant
from cp_compile.ops.core.triton_cache_write import _rint, _round_e4m3
from cp_compile.ops.quant.triton_int8_matmul import w8a8_dynamic_linear_device

# rope_mode -> (pairs in, split out, rotate in fp32)
_PAIRS = {"interleave": (True, False, False), "interleave_split": (True, True, False), "neox": (False, True, False),
          "interleave_fp32": (True, False, True)}


@triton.jit
def _rope(x, c, s, HALF: tl.constexpr, PAIRS: tl.constexpr, SPLIT_OUT: tl.constexpr):
    """Rotate rows x [M, 2 * HALF] by c / s [1, HALF] -> [M, 2 * HALF] in the layout of
    (PAIRS, SPLIT_OUT). Contiguous loads and stores only: pairs are split by a reshape,
    not by stride-2 addressing (which Triton-Ascend does not lower)."""
    M: tl.constexpr = x.shape[0]
    if PAIRS:
        x1, x2 = tl.split(tl.reshape(x, (M, HALF, 2)))
    else:
        x1, x2 = tl.split(tl.permute(tl.reshape(x, (M, 2, HALF)), (0, 2, 1)))
    r1 = x1 * c - x2 * s
    r2 = x2 * c + x1 * s
    if SPLIT_OUT:
        return tl.reshape(tl.permute(tl.join(r1, r2), (0, 2, 1)), (M, 2 * HALF))
    return tl.reshape(tl.join(r1, r2), (M, 2 * HALF))


@triton.jit
def _tail_rows(
    kv_ptr, q_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, kvc_ptr, kpe_ptr, qpe_ptr, scale_ptr,
    T, H, L, eps, block_size, qmax,
    s_kv, s_qt, s_qh, s_cos, s_cb, s_cs, s_sb, s_ss,
    NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    PAIRS: tl.constexpr, SPLIT_OUT: tl.constexpr, WRITE: tl.constexpr, ROPE_F32: tl.constexpr,
    QUANT: tl.constexpr, INT8: tl.constexpr,
):
    # The body of both kernels below. QUANT: the cache row is written as int8 / fp8 codes of
    # [kv_c | k_pe] with its fp32 scale at scale_ptr, the arithmetic of `_cache_write_quant_kernel`.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    cl = tl.arange(0, BLOCK_L)
    ci = tl.arange(0, HALF)
    cr = tl.arange(0, 2 * HALF)
    ch = tl.arange(0, BLOCK_H)
    ml = cl < L
    R: tl.constexpr = 2 * HALF
    for t in range(pid, T, nprog):
        # RMSNorm of the latent in fp32, output in the output's dtype.
        x = tl.load(kv_ptr + t * s_kv + cl, mask=ml, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / L + eps)
        normed = (x * r).to(kv_ptr.dtype.element_ty)
        w = tl.load(w_ptr + cl, mask=ml, other=0.0)
        kv_c = (w * normed).to(kvc_ptr.dtype.element_ty)
        tl.store(kvc_ptr + t * L + cl, kv_c, mask=ml)
        # Rope: cos / sin in the activation dtype, as the reference (ROPE_F32: everything in fp32).
        rope_ty = tl.float32 if ROPE_F32 else kv_ptr.dtype.element_ty
        c = tl.load(cos_ptr + t * s_cos + ci).to(rope_ty)[None, :]
        s = tl.load(sin_ptr + t * s_cos + ci).to(rope_ty)[None, :]
        k = tl.load(kv_ptr + t * s_kv + L + cr)[None, :]  # [1, R]
        if ROPE_F32:
            k = k.to(tl.float32)
        k_pe = _rope(k, c, s, HALF, PAIRS, SPLIT_OUT).to(kpe_ptr.dtype.element_ty)  # [1, R]
        tl.store(kpe_ptr + t * R + cr[None, :], k_pe)
        mh = (ch[:, None] < H) & (cr[None, :] < R)
        q = tl.load(q_ptr + t * s_qt + ch[:, None] * s_qh + NOPE + cr[None, :], mask=mh, other=0.0)  # [BH, R]
        if ROPE_F32:
            q = q.to(tl.float32)
        q_pe = _rope(q, c, s, HALF, PAIRS, SPLIT_OUT).to(qpe_ptr.dtype.element_ty)
        tl.store(qpe_ptr + (t * H + ch[:, None]) * R + cr[None, :], q_pe, mask=mh)
        if WRITE:
            slot = tl.load(slot_ptr + t)
            keep = slot >= 0
            s32 = tl.where(keep, slot, 0).to(tl.int32)
            row = cache_ptr + (s32 // block_size) * s_cb + (s32 % block_size) * s_cs
            if QUANT:
                # one scale for the row [kv_c | k_pe], from the values as stored in kv_c / k_pe
                yc = tl.where(ml, kv_c.to(tl.float32), 0.0)  # [BLOCK_L]
                yr = k_pe.to(tl.float32)  # [1, R]
                amax = tl.maximum(tl.max(tl.abs(yc), axis=0), tl.max(tl.max(tl.abs(yr), axis=1), axis=0))
                sc = tl.where(amax > 0.0, tl.math.div_rn(amax, qmax), 1.0)
                yc = tl.minimum(tl.maximum(tl.math.div_rn(yc, sc), -qmax), qmax)
                yr = tl.minimum(tl.maximum(tl.math.div_rn(yr, sc), -qmax), qmax)
                if INT8:
                    yc = _rint(yc)
                    yr = _rint(yr)
                else:
                    yc = _round_e4m3(yc)
                    yr = _round_e4m3(yr)
                tl.store(row + cl, yc.to(cache_ptr.dtype.element_ty), mask=cl < tl.where(keep, L, 0))
                tl.store(row + L + cr[None, :], yr.to(cache_ptr.dtype.element_ty),
                         mask=cr[None, :] < tl.where(keep, R, 0))
                tl.store(scale_ptr + (s32 // block_size) * s_sb + (s32 % block_size) * s_ss, sc, mask=keep)
            else:
                # a skipped token masks every column (as the cache-write kernel)
                tl.store(row + cl, kv_c.to(cache_ptr.dtype.element_ty), mask=cl < tl.where(keep, L, 0))
                tl.store(row + L + cr[None, :], k_pe.to(cache_ptr.dtype.element_ty),
                         mask=cr[None, :] < tl.where(keep, R, 0))


@triton.jit
def _mla_tail_kernel(
    kv_ptr, q_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, kvc_ptr, kpe_ptr, qpe_ptr,
    T, H, L, eps, block_size,
    s_kv, s_qt, s_qh, s_cos, s_cb, s_cs,
    NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    PAIRS: tl.constexpr, SPLIT_OUT: tl.constexpr, WRITE: tl.constexpr, ROPE_F32: tl.constexpr,
):
    """The latent written in the cache's (model) dtype, or not at all (WRITE False)."""
    _tail_rows(kv_ptr, q_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, kvc_ptr, kpe_ptr, qpe_ptr,
               kvc_ptr,  # scale pointer, never written (QUANT False)
               T, H, L, eps, block_size, 1.0, s_kv, s_qt, s_qh, s_cos, s_cb, s_cs, 0, 0,
               NOPE, HALF, BLOCK_L, BLOCK_H, PAIRS, SPLIT_OUT, WRITE, ROPE_F32, False, False)


@triton.jit
def _mla_tail_quant_kernel(
    kv_ptr, q_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, kvc_ptr, kpe_ptr, qpe_ptr, scale_ptr,
    T, H, L, eps, block_size, qmax,
    s_kv, s_qt, s_qh, s_cos, s_cb, s_cs, s_sb, s_ss,
    NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    PAIRS: tl.constexpr, SPLIT_OUT: tl.constexpr, ROPE_F32: tl.constexpr, INT8: tl.constexpr,
):
    """The latent written into an int8 / fp8 cache with its per-token scale (issue 39). A kernel of
    its own so the Triton-Ascend check can declare it absent by name."""
    _tail_rows(kv_ptr, q_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, kvc_ptr, kpe_ptr, qpe_ptr, scale_ptr,
               T, H, L, eps, block_size, qmax, s_kv, s_qt, s_qh, s_cos, s_cb, s_cs, s_sb, s_ss,
               NOPE, HALF, BLOCK_L, BLOCK_H, PAIRS, SPLIT_OUT, True, ROPE_F32, True, INT8)


def mla_preprocess_tail_triton(kv: torch.Tensor, q: torch.Tensor, kv_norm: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, eps: float, rope_mode: str, nope: int,
                               kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None, *,
                               num_programs: int | None = None,
                               kv_scale_cache: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kv [T, L + R], q [T, H, nope + R] (the GEMM outputs), kv_norm [L], cos / sin [T, R/2]
    -> (kv_c [T, L], k_pe [T, R], q_pe [T, H, R]); writes [kv_c | k_pe] at slot_mapping when given
    (an int8 / fp8 cache: quantised, its per-token scale into kv_scale_cache [NB, BS, 1])."""
    T, H = q.shape[0], q.shape[1]
    L = kv_norm.shape[0]
    half = cos.shape[-1]
    R = 2 * half
    if kv.shape[-1] != L + R or q.shape[-1] != nope + R or rope_mode not in _PAIRS or half != next_pow2(half):
        raise ValueError(f"mla tail: kv {tuple(kv.shape)}, q {tuple(q.shape)}, L={L}, R={R}, mode={rope_mode!r}")
    quant = kv_scale_cache is not None
    if quant:
        kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")  # type: ignore[arg-type]
        scales = kv_quant.scale_view(kv_cache, kv_scale_cache)  # type: ignore[arg-type]  # [NB, BS]
    kv, cos, sin = kv.contiguous(), cos.contiguous(), sin.contiguous()
    if q.stride(-1) != 1:
        q = q.contiguous()
    out_dtype = torch.result_type(kv_norm, kv)
    kv_c = kv.new_empty(T, L, dtype=out_dtype)
    k_pe = kv.new_empty(T, R)
    q_pe = q.new_empty(T, H, R)
    if T == 0:
        return kv_c, k_pe, q_pe
    write = kv_cache is not None
    cache = kv_cache if write else kv_c
    slots = slot_mapping.contiguous() if write else kv.new_zeros(1, dtype=torch.int64)
    require_int32_offsets(kv=kv, q=q, cache=cache, q_pe=q_pe)
    pairs, split, rope_f32 = _PAIRS[rope_mode]
    grid = (grid_size(T, kv.device, num_programs),)
    tiles = dict(NOPE=nope, HALF=half, BLOCK_L=next_pow2(L), BLOCK_H=next_pow2(H), PAIRS=pairs, SPLIT_OUT=split,
                 ROPE_F32=rope_f32)
    strides = (kv.stride(0), q.stride(0), q.stride(1), cos.stride(0),
               cache.stride(0) if write else 0, cache.stride(1) if write else 0)
    if quant:
        require_int32_offsets(kv_scale_cache=scales)
        kernel_for(_mla_tail_quant_kernel, kv.device)[grid](
            kv, q, kv_norm, cos, sin, slots, cache, kv_c, k_pe, q_pe, scales,
            T, H, L, float(eps), cache.shape[1], kv_quant.QMAX[cache.dtype],
            *strides, scales.stride(0), scales.stride(1),
            **tiles, INT8=cache.dtype == torch.int8,
        )
    else:
        kernel_for(_mla_tail_kernel, kv.device)[grid](
            kv, q, kv_norm, cos, sin, slots, cache, kv_c, k_pe, q_pe,
            T, H, L, float(eps), cache.shape[1] if write else 1, *strides,
            **tiles, WRITE=write,
        )
    return kv_c, k_pe, q_pe


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    # DeepSeek-R1 per rank at tp 8: L 512, R 64, 16 heads of nope 128; bf16; every rope layout.
    for mode in _PAIRS:
        kv = torch.empty(4, 576, dtype=torch.bfloat16)
        q = torch.empty(4, 16, 192, dtype=torch.bfloat16)
        cache = torch.empty(2, 16, 576, dtype=torch.bfloat16)
        yield (f"bf16 R1/tp8 {mode}", functools.partial(
            mla_preprocess_tail_triton, kv, q, torch.empty(512, dtype=torch.bfloat16), torch.empty(4, 32),
            torch.empty(4, 32), 1e-6, mode, 128, cache, torch.zeros(4, dtype=torch.int64)))
    # A quantised latent (issue 39): int8 / fp8 codes with one fp32 scale per token.
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        kv, q = torch.empty(4, 576, dtype=torch.bfloat16), torch.empty(4, 16, 192, dtype=torch.bfloat16)
        cache = torch.empty(2, 16, 576, dtype=qdtype)
        yield (f"bf16 R1/tp8 interleave, {str(qdtype)[6:]} latent", functools.partial(
            mla_preprocess_tail_triton, kv, q, torch.empty(512, dtype=torch.bfloat16), torch.empty(4, 32),
            torch.empty(4, 32), 1e-6, "interleave", 128, cache, torch.zeros(4, dtype=torch.int64),
            kv_scale_cache=torch.empty(2, 16, 1)))


# The quantised-KV ops are Absent on the NPU (docs/quant_kv.md), this kernel with them.
_QUANT_NOT_ON_NPU = ("the NPU declares the quantised-KV ops Absent (docs/quant_kv.md), cp::mla_preprocess_quant "
                     "with them; triton-ascend has no fp8 type")

LOWERING = LoweringDeclaration(
    examples=_lowering_examples,
    int64={"_mla_tail_kernel": "slot values are int64 data (vLLM's slot mapping dtype); cast to int32 once "
                               "after the -1 test, no int64 addressing",
           "_mla_tail_quant_kernel": "the same int64 slot mapping as _mla_tail_kernel"},
    helpers=("_rope", "_tail_rows", "_rint", "_round_e4m3"),
    not_on_ascend={"_mla_tail_quant_kernel": _QUANT_NOT_ON_NPU},
)


def mla_preprocess_device(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                          kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache, slot_mapping,
                          q_eps, kv_eps, rope_mode):
    """`cp::mla_preprocess` on an accelerator: library GEMMs (W8A8: the Triton int8 GEMM), the
    q-LoRA norm and the absorption in torch, the tail kernel above for the rest."""
    mla.check_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache, slot_mapping,
                   rope_mode)
    return _device(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset, kv_a_weight,
                   kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache, slot_mapping, q_eps, kv_eps,
                   rope_mode, None)


def _device(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset, kv_a_weight,
            kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache, slot_mapping, q_eps, kv_eps, rope_mode,
            kv_scale_cache):
    lin = functools.partial(ref.linear, w8a8=w8a8_dynamic_linear_device)
    T = x.shape[0]
    H, nope, _ = w_uk.shape
    if q_a_weight is not None:
        q_resid = ref.rms_norm(lin(x, q_a_weight, q_a_scale, q_a_offset), q_a_norm, q_eps)  # [T, q_lora]
        q = lin(q_resid, q_b_weight, q_b_scale, q_b_offset)
    else:
        q_resid = x.new_zeros(T, 0)
        q = lin(x, q_b_weight, q_b_scale, q_b_offset)
    q = q.view(T, H, -1)  # [T, H, nope + R]
    kv = lin(x, kv_a_weight, kv_a_scale, kv_a_offset)  # [T, L + R]
    kv_c, k_pe, q_pe = mla_preprocess_tail_triton(kv, q, kv_norm, cos, sin, kv_eps, rope_mode, nope, kv_cache,
                                                  slot_mapping, kv_scale_cache=kv_scale_cache)
    q_abs = torch.einsum("thn,hnl->thl", q[..., :nope], w_uk).contiguous()  # [T, H, L]
    return q_abs, q_pe, kv_c, k_pe, q_resid


def mla_preprocess_quant_device(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                                kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache,
                                kv_scale_cache, slot_mapping, q_eps, kv_eps, rope_mode):
    """`cp::mla_preprocess_quant` on an accelerator: as `mla_preprocess_device`, the tail kernel
    writing the latent quantised (`_mla_tail_quant_kernel`: `_cache_write_quant_kernel`'s codes and
    scales for the row [kv_c | k_pe])."""
    mla.check_quant_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache,
                         kv_scale_cache, slot_mapping, rope_mode)
    return _device(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset, kv_a_weight,
                   kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache, slot_mapping, q_eps, kv_eps,
                   rope_mode, kv_scale_cache)
