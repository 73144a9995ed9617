"""Query-tiled attention over a paged cache, returning (out, lse): prefill and chunked prefill.

The per-token decode kernel (paged_decode_lse.py) rereads a request's pages once per
query token; a prefill chunk of n tokens over a c-token context then reads n * c keys.
Here one work item is (BLOCK_M consecutive tokens of one request, one query head): the
tile streams the request's pages once in BLOCK_N-key tiles (tl.dot, online softmax in
fp32), each row masking keys to its own `kv_lens[t]` (causal, or a DCP rank's local
lengths). Tiles never straddle requests (they share a page table row): the tile ->
(request, first row) map is built on the device from query_start_loc over a static
bound of cdiv(T, BLOCK_M) + B tiles, so nothing is read back to the host.
Torch oracle: `cp_compile.ops.paged.reference.paged_attention_with_lse`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core import kv_quant
from cp_compile.ops.core.attention_tile import lse_epilogue, online_softmax_step, paged_location
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    require_int32_offsets,
    target_of,
)


@triton.jit
def _prefill_tiles(
    q_ptr, k_ptr, v_ptr, bt_ptr, treq_ptr, trow_ptr, qsl_ptr, kvlen_ptr, out_ptr, lse_ptr, ks_ptr, vs_ptr,
    scale,
    n_tiles, Hq, group, block_size, D, Dv,
    s_qt, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_bt,
    s_ot, s_oh, s_od,
    s_lt, s_lh,
    s_ksb, s_kss, s_ksh, s_vsb, s_vss, s_vsh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
    QUANT: tl.constexpr,
):
    # The body of both kernels below; QUANT: int8 / fp8 pages with an fp32 scale per
    # (page, offset, kv head) row in ks / vs (read through the block table like the rows).
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
        g = h // group
        req = tl.load(treq_ptr + tile)  # -1: a tile past the batch's last one
        row0 = tl.load(trow_ptr + tile)
        end = tl.load(qsl_ptr + tl.maximum(req, 0) + 1)
        end = tl.where(req >= 0, end, row0)  # a tile past the last one has no rows
        rows = row0 + offs_m
        r_mask = rows < end
        req = tl.maximum(req, 0)
        kvl = tl.load(kvlen_ptr + rows, mask=r_mask, other=0)
        hi = tl.max(kvl, axis=0)
        q = tl.load(q_ptr + rows[:, None] * s_qt + h * s_qh + offs_d[None, :] * s_qd,
                    mask=r_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, D_PAD]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
        for start in range(0, hi, BLOCK_N):
            j = start + offs_n
            j_mask = j < hi
            page, in_page = paged_location(bt_ptr, req, s_bt, j, j_mask, block_size)
            k = tl.load(k_ptr + (page * s_kb + in_page * s_ks + g * s_kh)[:, None] + offs_d[None, :] * s_kd,
                        mask=j_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            v = tl.load(v_ptr + (page * s_vb + in_page * s_vs + g * s_vh)[:, None] + offs_dv[None, :] * s_vd,
                        mask=j_mask[:, None] & dv_mask[None, :], other=0.0)  # [BLOCK_N, DV_PAD]
            if QUANT:  # dequantise on load (issue 39): codes * the row's scale in fp32, then q's dtype for tl.dot
                k_sc = tl.load(ks_ptr + page * s_ksb + in_page * s_kss + g * s_ksh, mask=j_mask, other=0.0)
                v_sc = tl.load(vs_ptr + page * s_vsb + in_page * s_vss + g * s_vsh, mask=j_mask, other=0.0)
                k = (k.to(tl.float32) * k_sc[:, None]).to(q_ptr.dtype.element_ty)
                v = (v.to(tl.float32) * v_sc[:, None]).to(q_ptr.dtype.element_ty)
            s = tl.dot(q, tl.trans(k)) * scale
            s = tl.where(j[None, :] < kvl[:, None], s, float("-inf"))
            # rows with fewer keys than the tile's: an all-masked row stays 0 (the helper's shift)
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        out, lse = lse_epilogue(acc, l_i, m_i)
        tl.store(out_ptr + rows[:, None] * s_ot + h * s_oh + offs_dv[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & dv_mask[None, :])
        tl.store(lse_ptr + rows * s_lt + h * s_lh, lse, mask=r_mask)


@triton.jit
def _paged_prefill_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, treq_ptr, trow_ptr, qsl_ptr, kvlen_ptr, out_ptr, lse_ptr,
    scale,
    n_tiles, Hq, group, block_size, D, Dv,
    s_qt, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_bt,
    s_ot, s_oh, s_od,
    s_lt, s_lh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
):
    """Pages in the model's dtype (no scale arguments: the signature of the tiles the AOT tables list)."""
    _prefill_tiles(q_ptr, k_ptr, v_ptr, bt_ptr, treq_ptr, trow_ptr, qsl_ptr, kvlen_ptr, out_ptr, lse_ptr,
                   lse_ptr, lse_ptr,  # scale pointers, never read (QUANT False)
                   scale, n_tiles, Hq, group, block_size, D, Dv,
                   s_qt, s_qh, s_qd, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, s_bt,
                   s_ot, s_oh, s_od, s_lt, s_lh,
                   0, 0, 0, 0, 0, 0,
                   BLOCK_M, BLOCK_N, D_PAD, DV_PAD, False)


@triton.jit
def _paged_prefill_quant_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, treq_ptr, trow_ptr, qsl_ptr, kvlen_ptr, out_ptr, lse_ptr, ks_ptr, vs_ptr,
    scale,
    n_tiles, Hq, group, block_size, D, Dv,
    s_qt, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_bt,
    s_ot, s_oh, s_od,
    s_lt, s_lh,
    s_ksb, s_kss, s_ksh, s_vsb, s_vss, s_vsh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, DV_PAD: tl.constexpr,
):
    """int8 / fp8 pages and their fp32 row scales (issue 39). A kernel of its own, not a
    constexpr of the one above, so the Triton-Ascend check can declare it absent by name."""
    _prefill_tiles(q_ptr, k_ptr, v_ptr, bt_ptr, treq_ptr, trow_ptr, qsl_ptr, kvlen_ptr, out_ptr, lse_ptr,
                   ks_ptr, vs_ptr,
                   scale, n_tiles, Hq, group, block_size, D, Dv,
                   s_qt, s_qh, s_qd, s_kb, s_ks, s_kh, s_kd, s_vb, s_vs, s_vh, s_vd, s_bt,
                   s_ot, s_oh, s_od, s_lt, s_lh,
                   s_ksb, s_kss, s_ksh, s_vsb, s_vss, s_vsh,
                   BLOCK_M, BLOCK_N, D_PAD, DV_PAD, True)


def request_tiles(query_start_loc: torch.Tensor, block_m: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, first row) of every query tile, int32 [cdiv(T, BLOCK_M) + B]; -1 / 0 past the last
    tile. Device ops only: the tile count is bounded by shapes, never read back."""
    qsl = query_start_loc.long()
    B = qsl.shape[0] - 1
    n_max = -(-num_tokens // block_m) + B
    per_req = (qsl[1:] - qsl[:-1] + block_m - 1) // block_m  # [B]
    ends = torch.cumsum(per_req, 0)  # [B]
    t = torch.arange(n_max, device=qsl.device)
    req = torch.searchsorted(ends, t, right=True)  # [n_max], B past the last tile
    real = req < B
    safe = req.clamp(max=max(B - 1, 0))
    row0 = qsl[safe] + (t - (ends[safe] - per_req[safe])) * block_m
    return (torch.where(real, req, torch.full_like(req, -1)).to(torch.int32),
            torch.where(real, row0, torch.zeros_like(row0)).to(torch.int32))


def paged_prefill_attention_lse_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]
    v_cache: torch.Tensor,  # [NB, BS, Hkv, Dv]
    block_table: torch.Tensor,  # [B, nb]
    query_start_loc: torch.Tensor,  # [B+1]
    kv_lens: torch.Tensor,  # [T]
    scale: float,
    *,
    num_programs: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    k_scale_cache: torch.Tensor | None = None,  # [NB, BS, Hkv] fp32: an int8 / fp8 k_cache's row scales
    v_scale_cache: torch.Tensor | None = None,  # [NB, BS, Hkv] fp32 (MLA: the latent's, as k's)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Query-tiled twin of `reference.paged_attention_with_lse` (same arguments and results).
    A quantised cache (both scale caches given) runs `_paged_prefill_quant_kernel`, which
    dequantises each K / V tile on load."""
    T, Hq, D = q.shape
    Hkv, Dv = v_cache.shape[2], v_cache.shape[3]
    if k_cache.shape[3] != D or v_cache.shape[:3] != k_cache.shape[:3] or Hq % Hkv:
        raise ValueError(f"cache shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    kv_quant.check_pair(k_cache, k_scale_cache, "k_cache")
    kv_quant.check_pair(v_cache, v_scale_cache, "v_cache")
    device = q.device
    # Padding tokens (past query_start_loc[-1]) belong to no tile: 0 / -inf, as in the reference.
    out = torch.zeros(T, Hq, Dv, dtype=q.dtype, device=device)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float32, device=device)
    if T == 0:
        return out, lse
    require_int32_offsets(q=q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, out=out)
    quant: tuple = ()
    if k_scale_cache is not None:
        ks = kv_quant.scale_view(k_cache, k_scale_cache)  # [NB, BS, Hkv]
        vs = kv_quant.scale_view(v_cache, v_scale_cache)  # type: ignore[arg-type]
        require_int32_offsets(k_scale_cache=ks, v_scale_cache=vs)
        quant = (ks, vs)
    d_pad, dv_pad = max(next_pow2(D), 16), max(next_pow2(Dv), 16)
    # Sized for the tensors' device, or the one a plan targets (tools/aot_cuda_check --production).
    default = 16 if target_of(device)[0] == "cpu" or max(d_pad, dv_pad) > 256 else 64
    block_m, block_n = block_m or default, block_n or default
    if min(block_m, block_n) < 16 or block_m & (block_m - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_m={block_m}, block_n={block_n}: powers of two >= 16 (tl.dot tiles)")
    qsl = query_start_loc.to(device=device, dtype=torch.int32).contiguous()
    tile_req, tile_row = request_tiles(qsl, block_m, T)
    n_tiles = tile_req.shape[0]
    grid = (grid_size(n_tiles * Hq, device, num_programs, uses_cube=True),)
    kernel = _paged_prefill_quant_kernel if quant else _paged_prefill_kernel
    kernel_for(kernel, device)[grid](
        q, k_cache, v_cache, block_table.to(torch.int32).contiguous(), tile_req, tile_row, qsl,
        kv_lens.to(device=device, dtype=torch.int32).contiguous(), out, lse, *quant, float(scale),
        n_tiles, Hq, Hq // Hkv, k_cache.shape[1], D, Dv,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), block_table.stride(0), *out.stride(), *lse.stride(),
        *(s for t in quant for s in t.stride()),
        BLOCK_M=block_m, BLOCK_N=block_n, D_PAD=d_pad, DV_PAD=dv_pad,
        # 64 x 64 tiles at D 128 spill 28 B on sm_80 with 4 warps (tools/aot_cuda_check.py --production).
        **({"num_warps": 8} if target_of(device)[0] == "cuda" and block_m >= 64 else {}),
    )
    return out, lse


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    bt = torch.zeros(1, 2, dtype=torch.int32)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    kv_lens = torch.ones(2, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16):
        for group, d in ((1, 128), (8, 128), (4, 64)) if dtype == torch.bfloat16 else ((8, 128),):
            q, kv = torch.empty(2, group, d, dtype=dtype), torch.empty(2, 16, 1, d, dtype=dtype)
            for blocks in (16, 64):
                yield (f"{str(dtype)[6:]} group {group} D {d} tiles {blocks}",
                       functools.partial(paged_prefill_attention_lse_triton, q, kv, kv, bt, qsl, kv_lens, d ** -0.5,
                                         block_m=blocks, block_n=blocks))
    q, cache = torch.empty(2, 16, 576, dtype=torch.bfloat16), torch.empty(2, 16, 576, dtype=torch.bfloat16)
    yield ("MLA bf16 16 heads 576 / 512", functools.partial(
        paged_prefill_attention_lse_triton, q, cache.unsqueeze(2), cache[..., :512].unsqueeze(2), bt, qsl, kv_lens,
        0.1))
    # Quantised pages (issue 39): int8 / fp8 codes with an fp32 scale per row, GQA and the MLA latent.
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        name = str(qdtype)[6:]
        q, kv, sc = (torch.empty(2, 8, 128, dtype=torch.bfloat16), torch.empty(2, 16, 1, 128, dtype=qdtype),
                     torch.empty(2, 16, 1))
        for blocks in (16, 64):
            yield (f"bf16 q, {name} pages, group 8 D 128 tiles {blocks}",
                   functools.partial(paged_prefill_attention_lse_triton, q, kv, kv, bt, qsl, kv_lens, 128 ** -0.5,
                                     block_m=blocks, block_n=blocks, k_scale_cache=sc, v_scale_cache=sc))
        q, cache = torch.empty(2, 16, 576, dtype=torch.bfloat16), torch.empty(2, 16, 576, dtype=qdtype)
        yield (f"MLA bf16 q, {name} latent, 16 heads 576 / 512", functools.partial(
            paged_prefill_attention_lse_triton, q, cache.unsqueeze(2), cache[..., :512].unsqueeze(2), bt, qsl,
            kv_lens, 0.1, k_scale_cache=sc, v_scale_cache=sc))


# The quantised-KV ops are Absent on the NPU (docs/quant_kv.md), this kernel with them. Lowered
# with this entry removed (2026-12-02, triton-ascend 3.2.0): the int8 launches reach linalg
# (303 / 316 lines, within the rules), the fp8 ones fail at TTIR ("unexpected type fp8").
_QUANT_NOT_ON_NPU = ("the NPU declares the quantised-KV ops Absent (docs/quant_kv.md): the int8 tiles lower to "
                     "linalg but nothing on the NPU launches them, and triton-ascend has no fp8 type "
                     "('unexpected type fp8' at TTIR)")

LOWERING = LoweringDeclaration(examples=_lowering_examples, helpers=("_prefill_tiles",),
                               not_on_ascend={"_paged_prefill_quant_kernel": _QUANT_NOT_ON_NPU})
