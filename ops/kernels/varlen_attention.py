"""Flash-style causal attention among each request's new tokens, returning (out, lse).

Queries are tiled: one work item is (BLOCK_M consecutive flattened tokens, one query
head). A tile may straddle requests; each row masks keys to its own request's new
tokens up to itself (`qsl[req] <= j <= t`), and the tile streams the union of its
rows' key ranges in BLOCK_N tiles with an online softmax in fp32. Memory is O(T):
no [H, T, T] score tensor (the reference builds one per request). Both products
use tl.dot (tensor cores / the cube), fp32 accumulation. Serves prefill, the
new-token half of chunked prefill (its context half is `cp::paged_attention_lse`)
and the PCP / DCP prefill compositions. Torch oracle: the CPU implementation of
`cp::varlen_causal_attention_lse` (`reference.paged_attention_with_lse` over the
new tokens as a block-size-1 cache).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.kernels._common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    require_int32_offsets,
)
from cp_compile.ops.layout import request_index


@triton.jit
def _varlen_attention_kernel(
    q_ptr, k_ptr, v_ptr, req_ptr, qsl_ptr, out_ptr, lse_ptr,
    scale,
    T, n_tiles, Hq, group, D, Dv,
    s_qt, s_qh, s_qd,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_ot, s_oh, s_od,
    s_lt, s_lh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_mask = offs_d < D
    dv_mask = offs_dv < Dv
    for w in range(pid, n_tiles * Hq, nprog):
        tile = w // Hq
        h = w % Hq
        g = h // group  # kv head
        rows = tile * BLOCK_M + offs_m  # [BLOCK_M] flattened tokens
        r_mask = rows < T
        req = tl.load(req_ptr + rows, mask=r_mask, other=-1)
        real = req >= 0  # padding rows attend nothing
        first = tl.load(qsl_ptr + tl.maximum(req, 0), mask=r_mask, other=0)  # row's first key
        lo = tl.min(tl.where(real, first, T), axis=0)  # union of the rows' key ranges
        hi = tl.max(tl.where(real, rows + 1, 0), axis=0)
        q = tl.load(q_ptr + rows[:, None] * s_qt + h * s_qh + offs_d[None, :] * s_qd,
                    mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + offs_n
            j_mask = j < hi
            k = tl.load(k_ptr + j[:, None] * s_kt + g * s_kh + offs_d[None, :] * s_kd,
                        mask=j_mask[:, None] & d_mask[None, :], other=0.0)
            v = tl.load(v_ptr + j[:, None] * s_vt + g * s_vh + offs_dv[None, :] * s_vd,
                        mask=j_mask[:, None] & dv_mask[None, :], other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_M, BLOCK_N] fp32
            see = (j[None, :] >= first[:, None]) & (j[None, :] <= rows[:, None]) & real[:, None]
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            # A row that sees no key of this tile (straddling tiles) keeps m = -inf:
            # shift by 0 there so no exp(-inf - -inf) = NaN appears.
            m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        has = l_i > 0.0
        l_safe = tl.where(has, l_i, 1.0)
        out = tl.where(has[:, None], acc / l_safe[:, None], 0.0)
        lse = tl.where(has, m_i + tl.log(l_safe), float("-inf"))
        tl.store(out_ptr + rows[:, None] * s_ot + h * s_oh + offs_dv[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & dv_mask[None, :])
        tl.store(lse_ptr + rows * s_lt + h * s_lh, lse, mask=r_mask)


def _tiles(device: torch.device, d_max: int, block_m: int | None, block_n: int | None) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 64 x 64 for head dims up to 128 on a device, 32 x 32 up to 256,
    16 x 16 for the wide MLA heads (576 / 512 padded to 1024: 32 x 32 tiles spill ~10 KB
    per thread on sm_80, docs/kernels_aot.md), 16 x 16 on CPU tensors (the interpreter)."""
    if device.type == "cpu":
        default = 16
    else:
        default = 64 if d_max <= 128 else 32 if d_max <= 256 else 16
    block_m, block_n = block_m or default, block_n or default
    for name, b in (("block_m", block_m), ("block_n", block_n)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name}={b}: a power of two >= 16 (tl.dot tiles)")
    return block_m, block_n


def varlen_attention_lse_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    *,
    num_programs: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out [T, Hq, Dv] in q.dtype, lse [T, Hq] fp32; padding tokens get 0 / -inf.
    Any strides (q / k / v may be slices of one projection)."""
    T, Hq, D = q.shape
    Hkv, Dv = v.shape[1], v.shape[2]
    if k.shape[:2] != v.shape[:2] or k.shape[0] != T or k.shape[2] != D or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need k [T, Hkv, D], "
                         "v [T, Hkv, Dv] with Hkv dividing Hq")
    device = q.device
    out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=device)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=device)
    if T == 0:
        return out, lse
    require_int32_offsets(q=q, k=k, v=v, out=out)
    d_pad, dv_pad = max(next_pow2(D), 16), max(next_pow2(Dv), 16)
    block_m, block_n = _tiles(device, max(d_pad, dv_pad), block_m, block_n)
    qsl = query_start_loc.to(device=device, dtype=torch.int32).contiguous()
    req = request_index(qsl, T).to(torch.int32)
    n_tiles = triton.cdiv(T, block_m)
    grid = (grid_size(n_tiles * Hq, device, num_programs, uses_cube=True),)
    kernel_for(_varlen_attention_kernel, device)[grid](
        q, k, v, req, qsl, out, lse, float(scale),
        T, n_tiles, Hq, Hq // Hkv, D, Dv,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(), *lse.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad, DV_PAD=dv_pad,
    )
    return out, lse


def varlen_causal_attention_lse_device(q, k, v, query_start_loc, scale):
    """`cp::varlen_causal_attention_lse` on an accelerator."""
    return varlen_attention_lse_triton(q, k, v, query_start_loc, scale)


# ----------------------------------------------------------------------------- lowering check

# GQA prefill (group, head dim) per rank, and the MLA chunked-prefill new-token part
# (keys [c; k_pe] 576, values c 512, one shared head).
_GQA_SHAPES = [(group, d) for d in (64, 128) for group in (1, 4, 8)]


def _lowering_examples():
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16):
        for group, d in _GQA_SHAPES if dtype == torch.bfloat16 else [(8, 128)]:
            q, kv = torch.empty(2, group, d, dtype=dtype), torch.empty(2, 1, d, dtype=dtype)
            for blocks in ((16, 16), (64, 64)):  # the CPU tiles and the device tiles
                yield (f"{str(dtype)[6:]} group {group} D {d} tiles {blocks}",
                       functools.partial(varlen_attention_lse_triton, q, kv, kv, qsl, d ** -0.5,
                                         block_m=blocks[0], block_n=blocks[1]))
    q, kv = torch.empty(2, 16, 576, dtype=torch.bfloat16), torch.empty(2, 1, 576, dtype=torch.bfloat16)
    yield ("MLA bf16 16 heads 576 / 512",
           functools.partial(varlen_attention_lse_triton, q, kv, kv[..., :512], qsl, 0.1, block_m=16, block_n=16))


LOWERING = LoweringDeclaration(examples=_lowering_examples)
