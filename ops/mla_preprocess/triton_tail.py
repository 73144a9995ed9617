"""MLAPO tail: kv_a_layernorm + rope on k_pe and q_pe + the latent cache write, one kernel.

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
from cp_compile.ops.core.triton_cache_write import cache_write_device
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
def _mla_tail_kernel(
    kv_ptr, q_ptr, w_ptr, cos_ptr, sin_ptr, slot_ptr, cache_ptr, kvc_ptr, kpe_ptr, qpe_ptr,
    T, H, L, eps, block_size,
    s_kv, s_qt, s_qh, s_cos, s_cb, s_cs,
    NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
    PAIRS: tl.constexpr, SPLIT_OUT: tl.constexpr, WRITE: tl.constexpr, ROPE_F32: tl.constexpr,
):
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
            # a skipped token masks every column (as the cache-write kernel)
            tl.store(row + cl, kv_c.to(cache_ptr.dtype.element_ty), mask=cl < tl.where(keep, L, 0))
            tl.store(row + L + cr[None, :], k_pe.to(cache_ptr.dtype.element_ty),
                     mask=cr[None, :] < tl.where(keep, R, 0))


def mla_preprocess_tail_triton(kv: torch.Tensor, q: torch.Tensor, kv_norm: torch.Tensor, cos: torch.Tensor,
                               sin: torch.Tensor, eps: float, rope_mode: str, nope: int,
                               kv_cache: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None, *,
                               num_programs: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """kv [T, L + R], q [T, H, nope + R] (the GEMM outputs), kv_norm [L], cos / sin [T, R/2]
    -> (kv_c [T, L], k_pe [T, R], q_pe [T, H, R]); writes [kv_c | k_pe] at slot_mapping when given."""
    T, H = q.shape[0], q.shape[1]
    L = kv_norm.shape[0]
    half = cos.shape[-1]
    R = 2 * half
    if kv.shape[-1] != L + R or q.shape[-1] != nope + R or rope_mode not in _PAIRS or half != next_pow2(half):
        raise ValueError(f"mla tail: kv {tuple(kv.shape)}, q {tuple(q.shape)}, L={L}, R={R}, mode={rope_mode!r}")
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
    kernel_for(_mla_tail_kernel, kv.device)[grid](
        kv, q, kv_norm, cos, sin, slots, cache, kv_c, k_pe, q_pe,
        T, H, L, float(eps), cache.shape[1] if write else 1,
        kv.stride(0), q.stride(0), q.stride(1), cos.stride(0),
        cache.stride(0) if write else 0, cache.stride(1) if write else 0,
        NOPE=nope, HALF=half, BLOCK_L=next_pow2(L), BLOCK_H=next_pow2(H), PAIRS=pairs, SPLIT_OUT=split,
        WRITE=write, ROPE_F32=rope_f32,
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


LOWERING = LoweringDeclaration(
    examples=_lowering_examples,
    int64={"_mla_tail_kernel": "slot values are int64 data (vLLM's slot mapping dtype); cast to int32 once "
                               "after the -1 test, no int64 addressing"},
    helpers=("_rope",),
)


def mla_preprocess_device(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                          kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache, slot_mapping,
                          q_eps, kv_eps, rope_mode):
    """`cp::mla_preprocess` on an accelerator: library GEMMs (W8A8: the Triton int8 GEMM), the
    q-LoRA norm and the absorption in torch, the tail kernel above for the rest."""
    mla.check_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache, slot_mapping,
                   rope_mode)
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
                                                  slot_mapping)
    q_abs = torch.einsum("thn,hnl->thl", q[..., :nope], w_uk).contiguous()  # [T, H, L]
    return q_abs, q_pe, kv_c, k_pe, q_resid


def mla_preprocess_quant_device(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                                kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache,
                                kv_scale_cache, slot_mapping, q_eps, kv_eps, rope_mode):
    """`cp::mla_preprocess_quant` on an accelerator: the tail kernel without its write, then the
    latent through the quantising cache-write kernel `cp::quant_cache_write` runs
    (`_cache_write_quant_kernel`: the same codes and scales)."""
    mla.check_quant_args(x, q_a_weight, q_a_norm, q_b_weight, kv_a_weight, kv_norm, w_uk, cos, kv_cache,
                         kv_scale_cache, slot_mapping, rope_mode)
    out = mla_preprocess_device(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                                kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, None, None, q_eps,
                                kv_eps, rope_mode)
    cache_write_device(torch.cat([out[2], out[3]], dim=-1), kv_cache, slot_mapping, kv_scale_cache)  # [T, L + R]
    return out
