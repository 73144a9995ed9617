"""Grouped int8 GEMM with exact int32 accumulation, for the W8A8 linears.

c[g] = a[g] @ b[g]: a int8 [G, M, K], b int8 [G, K, N] -> int32 [G, M, N]. One work
item is (group, BLOCK_M x BLOCK_N output tile); K is streamed in BLOCK_K slices
through tl.dot with an int32 accumulator (tensor cores' IMMA / the cube's int8
path). Integer arithmetic, so it equals the torch reference bit for bit. Why not
`torch._int_mm` on CUDA: it needs M > 16 and K, N multiples of 8, which a decode
step (a handful of tokens) does not meet, and it does not exist on the NPU
(docs/decisions.md). Torch oracle: `cp_compile.ops.quant.reference.int8_matmul`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.quant import reference as ref
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    require_int32_offsets,
)


@triton.jit
def _int8_matmul_kernel(
    a_ptr, b_ptr, c_ptr,
    n_work, n_mt, n_nt, M, N, K,
    s_ag, s_am, s_ak,
    s_bg, s_bk, s_bn,
    s_cg, s_cm, s_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    for w in range(pid, n_work, nprog):
        g = w // (n_mt * n_nt)
        rem = w % (n_mt * n_nt)
        m = (rem // n_nt) * BLOCK_M + offs_m
        n = (rem % n_nt) * BLOCK_N + offs_n
        m_mask = m < M
        n_mask = n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < K
            a = tl.load(a_ptr + g * s_ag + m[:, None] * s_am + k[None, :] * s_ak,
                        mask=m_mask[:, None] & k_mask[None, :], other=0)
            b = tl.load(b_ptr + g * s_bg + k[:, None] * s_bk + n[None, :] * s_bn,
                        mask=k_mask[:, None] & n_mask[None, :], other=0)
            # out_dtype named: triton 3.6 (the GPU machine's) defaults it to fp32 and asserts acc matches
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)  # int8 x int8 -> int32
        tl.store(c_ptr + g * s_cg + m[:, None] * s_cm + n[None, :] * s_cn, acc, mask=m_mask[:, None] & n_mask[None, :])


def int8_matmul_triton(a: torch.Tensor, b: torch.Tensor, *, num_programs: int | None = None,
                       block_m: int | None = None, block_n: int | None = None,
                       block_k: int | None = None) -> torch.Tensor:
    """Triton twin of `quant_reference.int8_matmul` for a [G, M, K] @ [G, K, N] (or 2-D) -> int32."""
    if a.dtype != torch.int8 or b.dtype != torch.int8:
        raise TypeError(f"int8_matmul_triton: int8 operands, got {a.dtype} and {b.dtype}")
    squeeze = a.dim() == 2
    if squeeze:
        a, b = a.unsqueeze(0), b.unsqueeze(0)
    G, M, K = a.shape
    if b.shape[0] != G or b.shape[1] != K:
        raise ValueError(f"int8_matmul_triton: a {tuple(a.shape)} and b {tuple(b.shape)} do not fit")
    N = b.shape[2]
    c = torch.empty(G, M, N, dtype=torch.int32, device=a.device)
    if G * M * N == 0:
        return c.zero_()[0] if squeeze else c.zero_()
    require_int32_offsets(a=a, b=b, c=c)
    block_m = block_m or min(64, max(16, next_pow2(M)))
    block_n = block_n or 64
    block_k = block_k or 64
    n_mt, n_nt = triton.cdiv(M, block_m), triton.cdiv(N, block_n)
    n_work = G * n_mt * n_nt
    grid = (grid_size(n_work, a.device, num_programs, uses_cube=True),)
    kernel_for(_int8_matmul_kernel, a.device)[grid](
        a, b, c, n_work, n_mt, n_nt, M, N, K, *a.stride(), *b.stride(), *c.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return c[0] if squeeze else c


# ----------------------------------------------------------------------------- the ops' device kernels


def w8a8_dynamic_linear_device(x, weight, weight_scale, weight_offset, groups):
    """`cp::w8a8_dynamic_linear` on an accelerator: the reference's quantisation (vectorised torch) and
    dequantisation around the Triton int8 GEMM."""
    ref.check_linear(x, weight, groups)
    return ref.w8a8_dynamic_linear(x, weight, weight_scale, weight_offset, groups, matmul=int8_matmul_triton)


def w8a8_static_linear_device(x, weight, input_scale, input_offset, quant_bias, deq_scale):
    """`cp::w8a8_static_linear` on an accelerator (see `w8a8_dynamic_linear_device`)."""
    ref.check_linear(x, weight, input_scale.shape[0])
    return ref.w8a8_static_linear(x, weight, input_scale, input_offset, quant_bias, deq_scale,
                                  matmul=int8_matmul_triton)


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    # Decode (a few tokens) and prefill row counts; the o_proj of a TP rank (1 group)
    # and the DSA-CP full-weight o_proj (tp groups).
    for M in (1, 16, 64, 256):
        for G in (1, 4):
            yield (f"M {M} groups {G}",
                   functools.partial(int8_matmul_triton, torch.empty(G, M, 128, dtype=torch.int8),
                                     torch.empty(G, 128, 256, dtype=torch.int8)))


LOWERING = LoweringDeclaration(examples=_lowering_examples)
