"""Paged attention over a prefix of each request's keys, returning (out, lse).

Flash-decode style: one work item is (token, kv head, block of query heads of that
kv head's group); it streams the request's pages in BLOCK_N-key tiles with an online
softmax in fp32. The LSE output is what the DCP merge needs (docs/architecture.md §5).
Torch oracle: `cp_compile.ops.paged.reference.paged_attention_with_lse`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.attention_tile import lse_epilogue, online_softmax_step, paged_location
from cp_compile.ops.paged import launch as paged_launch
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    prev_pow2,
    require_int32_offsets,
)
from cp_compile.ops.core.layout import request_index

# Elements of the [BLOCK_H, BLOCK_N, D] broadcast product a tile may hold. Bounds
# registers / UB on device and keeps interpreter tiles small.
_TILE_BUDGET = 8192


@triton.jit
def _paged_attention_lse_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, kvlen_ptr, out_ptr, lse_ptr,
    scale,
    n_work, Hkv, group, n_hblk, block_size, D, Dv,
    s_qt, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_bt,
    s_ot, s_oh, s_od,
    s_lt, s_lh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, USE_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)  # query heads inside the group block
    offs_n = tl.arange(0, BLOCK_N)  # keys inside the tile
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_mask = offs_d < D
    dv_mask = offs_dv < Dv

    # Persistent loop: the grid is at most the core count, each program strides over
    # the (token, kv head, head block) work items.
    for w in range(pid, n_work, nprog):
        t = w // (Hkv * n_hblk)
        rem = w % (Hkv * n_hblk)
        g = rem // n_hblk
        hg = (rem % n_hblk) * BLOCK_H + offs_h  # head index inside the GQA group
        h_mask = hg < group
        h = g * group + hg  # query head (GQA: q head h reads kv head h // group)

        req = tl.load(req_ptr + t)
        n_kv = tl.load(kvlen_ptr + t)
        n_kv = tl.where(req >= 0, n_kv, 0)  # padding tokens attend nothing
        req = tl.maximum(req, 0)

        # int32 offsets throughout: the launcher checked every tensor's span fits.
        q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, D_PAD]
        if not USE_DOT:
            q = q.to(tl.float32) * scale  # scale folded once instead of per tile

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp
        acc = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
        for start in range(0, n_kv, BLOCK_N):
            j = start + offs_n  # request-local key positions [BLOCK_N]
            j_mask = j < n_kv
            page, in_page = paged_location(bt_ptr, req, s_bt, j, j_mask, block_size)
            k_row = page * s_kb + in_page * s_ks + g * s_kh  # [BLOCK_N]
            v_row = page * s_vb + in_page * s_vs + g * s_vh
            k = tl.load(k_ptr + k_row[:, None] + offs_d[None, :] * s_kd,
                        mask=j_mask[:, None] & d_mask[None, :], other=0.0)
            v = tl.load(v_ptr + v_row[:, None] + offs_dv[None, :] * s_vd,
                        mask=j_mask[:, None] & dv_mask[None, :], other=0.0)
            if USE_DOT:
                # Cube path: operands in their own dtype, fp32 accumulation (needs
                # BLOCK_H, BLOCK_N and the padded head dims >= 16).
                s = tl.dot(q, tl.trans(k)) * scale  # [BLOCK_H, BLOCK_N]
            else:
                # Broadcast-multiply-reduce in fp32: valid for any tile size (GQA
                # groups are small) and runs everywhere, including the interpreter.
                s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            s = tl.where(j_mask[None, :], s, float("-inf"))
            # The tile holds >= 1 valid key (start < n_kv), so the new max is finite.
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            if USE_DOT:
                pv = tl.dot(p.to(v.dtype), v)  # fp32 accumulator
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [BLOCK_H, DV_PAD]
            acc = acc * alpha[:, None] + pv

        # No keys: l_i = 0 -> out 0, lse -inf (the merge weighs it 0).
        out, lse = lse_epilogue(acc, l_i, m_i)
        tl.store(out_ptr + t * s_ot + h[:, None] * s_oh + offs_dv[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
        tl.store(lse_ptr + t * s_lt + h * s_lh, lse, mask=h_mask)


def paged_attention_with_lse_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]   (any strides)
    v_cache: torch.Tensor,  # [NB, BS, Hkv, Dv]  (any strides, e.g. an MLA slice view)
    block_table: torch.Tensor,  # [B, nb] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    kv_lens: torch.Tensor,  # [T] int32: token t attends positions 0..kv_lens[t]-1
    scale: float,
    *,
    num_programs: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    use_dot: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `reference.paged_attention_with_lse`.

    Returns out [T, Hq, Dv] in q.dtype and lse [T, Hq] fp32 (natural log); a token
    with no keys (kv_lens 0 or padding past query_start_loc[-1]) gets out 0, lse -inf.

    MLA (absorbed) passes k_cache = kv_cache.unsqueeze(2) [NB, BS, 1, L+R] and
    v_cache = kv_cache[..., :L].unsqueeze(2); no copy is made, strides are honoured.

    num_programs: persistent grid size (default: the device's core count).
    block_h / block_n: query heads / keys per tile (powers of two).
    use_dot: score and PV products with tl.dot in the input dtype, fp32 accumulation
    (cube units; needs block_h, block_n and padded head dims >= 16; on CUDA fp32
    inputs may then run in tf32).
    """
    T, Hq, D = q.shape
    NB, BS, Hkv, Dk = k_cache.shape
    Dv = v_cache.shape[3]
    if Dk != D or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"Hq={Hq} is not a multiple of Hkv={Hkv}")
    group = Hq // Hkv
    device = q.device

    out = torch.empty(T, Hq, Dv, dtype=q.dtype, device=device)
    lse = torch.empty(T, Hq, dtype=torch.float32, device=device)
    if T == 0:
        return out, lse
    require_int32_offsets(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, out=out)

    d_pad, dv_pad = next_pow2(D), next_pow2(Dv)
    block_h, block_n = _tiles(group, max(d_pad, dv_pad), block_h, block_n)
    n_hblk = triton.cdiv(group, block_h)

    # Request of each token (-1 = padding), found once on the host side of the launch.
    req = request_index(query_start_loc.to(device=device, dtype=torch.int32), T).to(torch.int32)
    kv_lens = kv_lens.to(device=device, dtype=torch.int32).contiguous()
    block_table = block_table.to(torch.int32).contiguous()  # kernel assumes unit column stride
    n_work = T * Hkv * n_hblk
    grid = (grid_size(n_work, device, num_programs, uses_cube=use_dot),)
    kernel_for(_paged_attention_lse_kernel, device)[grid](
        q, k_cache, v_cache, block_table, req, kv_lens, out, lse,
        float(scale),
        n_work, Hkv, group, n_hblk, BS, D, Dv,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_table.stride(0),
        *out.stride(),
        *lse.stride(),
        BLOCK_H=block_h, BLOCK_N=block_n, D_PAD=d_pad, DV_PAD=dv_pad, USE_DOT=use_dot,
    )
    return out, lse


def _tiles(group: int, d_max: int, block_h: int | None, block_n: int | None) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_N): the heads of one GQA group per tile, shrunk for wide (MLA)
    heads before the key tile is, within _TILE_BUDGET elements."""
    if block_h is None:
        block_h = min(next_pow2(group), 16)
        while block_h > 1 and block_h * 8 * d_max > _TILE_BUDGET:
            block_h //= 2
    if block_n is None:
        block_n = max(8, min(64, prev_pow2(_TILE_BUDGET // (block_h * d_max))))
    if block_h & (block_h - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_h={block_h} and block_n={block_n} must be powers of two")
    return block_h, block_n


# ----------------------------------------------------------------------------- lowering check

# Per-rank attention shapes the project serves: GQA head dims and query heads per KV
# head after TP; MLA over the 512 + 64 latent with 1 .. 128 local heads (DeepSeek-V3
# at tp 1 .. 128). Small T and cache: only shapes, dtypes and constexprs matter here.
_GQA_SHAPES = [(group, d) for d in (64, 128, 256) for group in (1, 2, 4, 8, 16)]
_MLA_HEADS = (1, 16, 128)


def _lowering_examples():
    # The registered kernels (launch.py) are what device runs launch.
    bt = torch.zeros(1, 2, dtype=torch.int32)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    kv_lens = torch.ones(2, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for group, d in _GQA_SHAPES if dtype == torch.bfloat16 else [(8, 128)]:
            q = torch.empty(2, group, d, dtype=dtype)
            kv = torch.empty(2, 16, 1, d, dtype=dtype)
            yield (f"GQA {str(dtype)[6:]} group {group} D {d}",
                   functools.partial(paged_launch.paged_attention_lse, q, kv, kv, bt, qsl, kv_lens, d ** -0.5))
    for heads in _MLA_HEADS:
        q_nope, q_pe = torch.empty(2, heads, 512, dtype=torch.bfloat16), torch.empty(2, heads, 64, dtype=torch.bfloat16)
        cache = torch.empty(2, 16, 576, dtype=torch.bfloat16)
        yield (f"MLA bf16 {heads} heads 512+64",
               functools.partial(paged_launch.mla_partial_attention, q_nope, q_pe, cache, bt, qsl, kv_lens, 0.1))
    # The cube path (tests launch it; the intended MLA path on AI cores).
    q = torch.empty(2, 16, 576, dtype=torch.bfloat16)
    cache = torch.empty(2, 16, 576, dtype=torch.bfloat16)
    yield ("MLA bf16 16 heads 512+64, tl.dot",
           functools.partial(paged_attention_with_lse_triton, q, cache.unsqueeze(2), cache[..., :512].unsqueeze(2),
                             bt, qsl, kv_lens, 0.1, block_h=16, block_n=16, use_dot=True))


LOWERING = LoweringDeclaration(examples=_lowering_examples)
