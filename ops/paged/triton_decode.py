"""Paged attention over a prefix of each request's keys, returning (out, lse).

Flash-decode style: one work item is (token, kv head, block of query heads of that
kv head's group, KV split); it streams its split of the request's pages in BLOCK_N-key
tiles with an online softmax in fp32. With more than one split (CUDA, the interpreter)
each split writes an fp32 partial and `_split_merge_kernel` merges them by LSE; the NPU
launches one split on its persistent grid (docs/decisions.md 54, docs/kernels.md
"Split-KV decode"). The LSE output is what the DCP merge needs (docs/architecture.md §5).
Torch oracle: `cp_compile.ops.paged.reference.paged_attention_with_lse`.

A quantised cache (int8 / fp8, issue 39) is dequantised on load: right after a tile's
K / V rows are loaded, each row is multiplied by its fp32 scale (`QUANT`, the scale
caches beside the pages), and the tile goes on in fp32 (in q's dtype on the tl.dot path).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core import kv_quant
from cp_compile.ops.core.attention_tile import lse_epilogue, lse_merge_rows, online_softmax_step, paged_location
from cp_compile.ops.paged import launch as paged_launch
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    prev_pow2,
    require_int32_offsets,
    target_of,
)
from cp_compile.ops.core.layout import request_index
from cp_compile.ops.core.split_kv import kv_splits

# Elements of the [BLOCK_H, BLOCK_N, D] broadcast product a tile may hold. Bounds
# registers / UB on device and keeps interpreter tiles small.
_TILE_BUDGET = 8192


@triton.jit
def _paged_attention_lse_kernel(
    q_ptr, k_ptr, v_ptr, bt_ptr, req_ptr, kvlen_ptr, out_ptr, lse_ptr, ks_ptr, vs_ptr,
    scale,
    n_work, Hkv, group, n_hblk, n_splits, split_len, block_size, D, Dv, D1,
    s_qt, s_qh, s_qd,
    s_kb, s_ks, s_kh, s_kd,
    s_vb, s_vs, s_vh, s_vd,
    s_bt,
    s_os, s_ot, s_oh, s_od,
    s_ls, s_lt, s_lh,
    s_ksb, s_kss, s_ksh, s_vsb, s_vss, s_vsh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D_PAD: tl.constexpr, DV_PAD: tl.constexpr, DR_PAD: tl.constexpr, USE_DOT: tl.constexpr,
    QUANT: tl.constexpr,
):
    # DR_PAD = 0: a key row is one block of D columns (D_PAD), V a row of its own.
    # DR_PAD > 0 (MLA): the key row is D1 = Dv latent columns, which are also the value
    # row (read once), then D - D1 rope columns (DR_PAD): two products, 512 + 64, no pad
    # of 576 to 1024.
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)  # query heads inside the group block
    offs_n = tl.arange(0, BLOCK_N)  # keys inside the tile
    offs_d = tl.arange(0, D_PAD)
    offs_dv = tl.arange(0, DV_PAD)
    d_mask = offs_d < D1
    dv_mask = offs_dv < Dv

    # Persistent loop over the (token, kv head, KV split, head block) work items; the
    # head block is innermost, so the blocks that read the same keys (MLA's 128 heads in
    # blocks of 64) are neighbours in the grid, resident at once, and all but the first
    # read the split's rows from L2. NPU: grid <= cores, n_splits 1; CUDA: one program
    # per item.
    for w in range(pid, n_work, nprog):
        hb = w % n_hblk
        w2 = w // n_hblk
        sp = w2 % n_splits  # KV split: keys [sp * split_len, (sp + 1) * split_len)
        w3 = w2 // n_splits
        t = w3 // Hkv
        g = w3 % Hkv
        hg = hb * BLOCK_H + offs_h  # head index inside the GQA group
        h_mask = hg < group
        h = g * group + hg  # query head (GQA: q head h reads kv head h // group)

        req = tl.load(req_ptr + t)
        n_kv = tl.load(kvlen_ptr + t)
        n_kv = tl.where(req >= 0, n_kv, 0)  # padding tokens attend nothing
        req = tl.maximum(req, 0)
        # This split's keys; split_len needs no alignment to BLOCK_N or to a page, and a
        # split past n_kv is empty (lo >= hi: no tile, the decision-47 epilogue below).
        lo = sp * split_len
        hi = tl.minimum(lo + split_len, n_kv)

        # int32 offsets throughout: the launcher checked every tensor's span fits.
        q = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_H, D_PAD]
        if not USE_DOT:
            q = q.to(tl.float32) * scale  # scale folded once instead of per tile
        if DR_PAD > 0:
            offs_r = D1 + tl.arange(0, DR_PAD)  # rope columns
            r_mask = offs_r < D
            q_pe = tl.load(q_ptr + t * s_qt + h[:, None] * s_qh + offs_r[None, :] * s_qd,
                           mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, DR_PAD]
            if not USE_DOT:
                q_pe = q_pe.to(tl.float32) * scale

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp
        acc = tl.zeros([BLOCK_H, DV_PAD], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + offs_n  # request-local key positions [BLOCK_N]
            j_mask = j < hi
            page, in_page = paged_location(bt_ptr, req, s_bt, j, j_mask, block_size)
            k_row = page * s_kb + in_page * s_ks + g * s_kh  # [BLOCK_N]
            v_row = page * s_vb + in_page * s_vs + g * s_vh
            k = tl.load(k_ptr + k_row[:, None] + offs_d[None, :] * s_kd,
                        mask=j_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            if DR_PAD > 0:
                k_pe = tl.load(k_ptr + k_row[:, None] + offs_r[None, :] * s_kd,
                               mask=j_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, DR_PAD]
                v = k  # MLA: the latent columns are the values (D_PAD == DV_PAD)
            else:
                v = tl.load(v_ptr + v_row[:, None] + offs_dv[None, :] * s_vd,
                            mask=j_mask[:, None] & dv_mask[None, :], other=0.0)  # [BLOCK_N, DV_PAD]
            if QUANT:  # dequantise on load (issue 39): codes * the row's scale, fp32
                k_sc = tl.load(ks_ptr + page * s_ksb + in_page * s_kss + g * s_ksh, mask=j_mask, other=0.0)
                k = k.to(tl.float32) * k_sc[:, None]
                if DR_PAD > 0:
                    k_pe = k_pe.to(tl.float32) * k_sc[:, None]
                    v = k
                else:
                    v_sc = tl.load(vs_ptr + page * s_vsb + in_page * s_vss + g * s_vsh, mask=j_mask, other=0.0)
                    v = v.to(tl.float32) * v_sc[:, None]
                if USE_DOT:  # tl.dot takes both operands in q's dtype
                    k = k.to(q_ptr.dtype.element_ty)
                    v = v.to(q_ptr.dtype.element_ty)
                    if DR_PAD > 0:
                        k_pe = k_pe.to(q_ptr.dtype.element_ty)
            if USE_DOT:
                # Cube / tensor-core path: the whole (padded) head group as the M side
                # of one product, operands in their own dtype, fp32 accumulation (needs
                # BLOCK_H, BLOCK_N and the padded head dims >= 16).
                s = tl.dot(q, tl.trans(k))  # [BLOCK_H, BLOCK_N]
                if DR_PAD > 0:
                    s += tl.dot(q_pe, tl.trans(k_pe))
                s = s * scale
            else:
                # Broadcast-multiply-reduce in fp32: valid for any tile size (GQA
                # groups are small) and runs everywhere, including the interpreter.
                s = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
                if DR_PAD > 0:
                    s += tl.sum(q_pe[:, None, :] * k_pe.to(tl.float32)[None, :, :], axis=2)
            s = tl.where(j_mask[None, :], s, float("-inf"))
            # The tile holds >= 1 valid key (start < hi), so the new max is finite.
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            if USE_DOT:
                pv = tl.dot(p.to(v.dtype), v)  # fp32 accumulator
            else:
                pv = tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)  # [BLOCK_H, DV_PAD]
            acc = acc * alpha[:, None] + pv

        # No keys in this split (empty shard, short request, padding): l_i = 0 -> out 0,
        # lse -inf, which the split merge (and the DCP merge) weigh 0.
        out, lse = lse_epilogue(acc, l_i, m_i)
        tl.store(out_ptr + sp * s_os + t * s_ot + h[:, None] * s_oh + offs_dv[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
        tl.store(lse_ptr + sp * s_ls + t * s_lt + h * s_lh, lse, mask=h_mask)


@triton.jit
def _split_merge_kernel(
    po_ptr, pl_ptr, out_ptr, lse_ptr,
    n_splits, n_rows, H, Dv, n_dblk,
    s_ps, s_pt, s_ph, s_pd,
    s_qs, s_qt, s_qh,
    s_ot, s_oh, s_od,
    s_lt, s_lh,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Second stage of the split decode: the LSE merge (`lse_merge_rows` of
    core/attention_tile.py, the one ops/merge's kernels use: out = sum_s out_s
    exp(lse_s - LSE), LSE = logsumexp_s lse_s) over the KV splits of each (token, head)
    row, written in the output dtype. An empty split (lse -inf) weighs 0 and its out is
    not read into the sum; an all-empty row is out 0, lse -inf; a NaN / +inf partial
    makes its row NaN (decision 47). Work items are (row block, BLOCK_D columns of Dv):
    a decode batch has few rows, and the columns are what spreads its partials over the
    cores (each item re-reads its rows' LSEs, S x 4 bytes a row, against S x BLOCK_D x 4 of partial outputs)."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_r = tl.arange(0, BLOCK_R)
    n_blocks = (n_rows + BLOCK_R - 1) // BLOCK_R * n_dblk
    for wi in range(pid, n_blocks, nprog):
        rb = wi // n_dblk
        offs_d = (wi % n_dblk) * BLOCK_D + tl.arange(0, BLOCK_D)  # this item's Dv columns
        d_mask = offs_d < Dv
        r = rb * BLOCK_R + offs_r  # flattened (token, head) rows [BLOCK_R]
        r_mask = r < n_rows
        t = r // H
        h = r % H
        tile_mask = r_mask[:, None] & d_mask[None, :]
        res, lse = lse_merge_rows(po_ptr, pl_ptr, t * s_pt + h * s_ph, t * s_qt + h * s_qh, offs_d * s_pd,
                                  s_ps, s_qs, n_splits, r_mask, tile_mask, BLOCK_R, BLOCK_D)
        tl.store(out_ptr + t[:, None] * s_ot + h[:, None] * s_oh + offs_d[None, :] * s_od,
                 res.to(out_ptr.dtype.element_ty), mask=tile_mask)
        first_cols = (offs_r * 0 + wi % n_dblk) == 0  # [BLOCK_R]: the row's LSE is stored once
        tl.store(lse_ptr + t * s_lt + h * s_lh, lse, mask=r_mask & first_cols)


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
    use_dot: bool | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    k_scale_cache: torch.Tensor | None = None,
    v_scale_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `reference.paged_attention_with_lse`.

    k_scale_cache / v_scale_cache: a quantised (int8 / fp8) cache's row scales
    ([NB, BS, Hkv] fp32), dequantised on load (issue 39).

    Returns out [T, Hq, Dv] in q.dtype and lse [T, Hq] fp32 (natural log); a token
    with no keys (kv_lens 0 or padding past query_start_loc[-1]) gets out 0, lse -inf.

    MLA (absorbed) passes k_cache = kv_cache.unsqueeze(2) [NB, BS, 1, L+R] and
    v_cache = kv_cache[..., :L].unsqueeze(2); no copy is made, strides are honoured.

    Split-KV (docs/decisions.md 54): the keys a request can have (block table width x
    page size) are cut into num_splits ranges, each a work item of its own writing an
    fp32 partial (out, lse) per split, and `_split_merge_kernel` merges them by LSE.
    Default num_splits: enough to fill two waves of the device's cores (`kv_splits`) on
    CUDA and under the interpreter (CPU_MAX_PROGRAMS cores); 1 on the NPU, whose
    persistent per-core grid is already full at one program per core (one launch, no
    partials). The split count comes from shapes and the core count only.

    num_programs: persistent grid size (default: CUDA one program per work item, NPU /
    CPU the core count).
    block_h / block_n: query heads / keys per tile (powers of two).
    use_dot: score and PV products with tl.dot in the input dtype, fp32 accumulation,
    the head group padded to >= 16 rows (default: on CUDA; on CUDA fp32 inputs may then
    run in tf32). Off: the fp32 broadcast product (NPU vector cores, the interpreter).
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

    # Sized for the tensors' device, or the one a plan targets (tools/device_check --plan).
    target = target_of(device)[0]
    if use_dot is None:
        use_dot = target == "cuda"
    cores = target_of(device, uses_cube=use_dot)[1]

    # MLA: v_cache is k_cache's first Dv columns (same storage, same strides; metadata,
    # not values): the key row splits into latent (= value) and rope columns.
    same_rows = all(sv == sk for n, sv, sk in zip(k_cache.shape, v_cache.stride(), k_cache.stride()) if n > 1)
    mla = Dv < D and v_cache.data_ptr() == k_cache.data_ptr() and same_rows  # (a size-1 dim's stride is moot)
    d1 = Dv if mla else D  # key columns of the first product
    d_pad, dv_pad = next_pow2(d1), next_pow2(Dv)
    dr_pad = next_pow2(D - Dv) if mla else 0
    d_max = max(d_pad, dv_pad) + dr_pad  # columns a key row's tiles hold
    warps = 4  # Triton's default
    if use_dot and mla:
        dot_h, dot_n, warps = _mla_dot_tiles(group)
        block_h, block_n = _tiles(group, d_max, block_h or dot_h, block_n or dot_n)
    elif use_dot:
        dot_h, dot_n = _dot_tiles(group, d_max)
        block_h, block_n = _tiles(group, d_max, block_h or dot_h, block_n or dot_n)
        # 64 heads x 64 keys at D 128 spill 64 B on sm_80 with 4 warps, none with 8
        # (tools/aot_cuda_check.py --production, docs/kernels_aot.md).
        warps = 8 if block_h >= 64 else 4
    else:
        block_h, block_n = _tiles(group, d_max, block_h, block_n)
    n_hblk = triton.cdiv(group, block_h)
    n_items = T * Hkv * n_hblk

    # Keys a request can have: the block table's static width, never a kv_lens value.
    max_keys = block_table.shape[1] * BS
    if num_splits is None:
        if target == "npu":
            num_splits, split_len = 1, max_keys
        else:
            num_splits, split_len = kv_splits(n_items, max_keys, cores)
    elif num_splits >= 1:
        split_len = triton.cdiv(max_keys, num_splits)  # tests: any length, mid-tile, mid-page
    else:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits == 1:
        # One split must cover any kv_len (a large bound, not the table width, so the
        # unsplit launch reads exactly what it always did).
        split_len = 2**30

    # Request of each token (-1 = padding), found once on the host side of the launch.
    req = request_index(query_start_loc.to(device=device, dtype=torch.int32), T).to(torch.int32)
    kv_lens = kv_lens.to(device=device, dtype=torch.int32).contiguous()
    block_table = block_table.to(torch.int32).contiguous()  # kernel assumes unit column stride
    n_work = n_items * num_splits
    if num_programs is None:
        # CUDA: one program per item, the hardware schedules the waves; NPU / CPU: a
        # persistent grid of one program per core.
        num_programs = n_work if target == "cuda" else cores
    grid = (grid_size(n_work, device, num_programs),)
    if num_splits == 1:
        part_out, part_lse = out, lse  # written directly, no merge
        s_po, s_pl = 0, 0
    else:
        part_out = torch.empty(num_splits, T, Hq, Dv, dtype=torch.float32, device=device)  # [S, T, Hq, Dv]
        part_lse = torch.empty(num_splits, T, Hq, dtype=torch.float32, device=device)  # [S, T, Hq]
        require_int32_offsets(part_out=part_out)
        s_po, s_pl = part_out.stride(0), part_lse.stride(0)
    quant = k_scale_cache is not None
    if quant:
        ks = kv_quant.scale_view(k_cache, k_scale_cache)  # [NB, BS, Hkv]
        vs = kv_quant.scale_view(v_cache, v_scale_cache)  # type: ignore[arg-type]
        require_int32_offsets(k_scale_cache=ks, v_scale_cache=vs)
        scale_strides = (*ks.stride(), *vs.stride())
    else:
        ks = vs = lse  # never read (QUANT=False): any pointer
        scale_strides = (0,) * 6
    kernel_for(_paged_attention_lse_kernel, device)[grid](
        q, k_cache, v_cache, block_table, req, kv_lens, part_out, part_lse, ks, vs,
        float(scale),
        n_work, Hkv, group, n_hblk, num_splits, split_len, BS, D, Dv, d1,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_table.stride(0),
        s_po, *part_out.stride()[-3:],
        s_pl, *part_lse.stride()[-2:],
        *scale_strides,
        BLOCK_H=block_h, BLOCK_N=block_n, D_PAD=d_pad, DV_PAD=dv_pad, DR_PAD=dr_pad, USE_DOT=use_dot,
        QUANT=quant,
        **({"num_warps": num_warps or warps} if target == "cuda" else {}),
    )
    if num_splits > 1:
        n_rows = T * Hq
        block_d = min(dv_pad, _MERGE_BLOCK_D)
        n_dblk = triton.cdiv(Dv, block_d)
        # Largest row block (<= 16) that still gives every core an item.
        block_r = min(16, next_pow2(n_rows))
        while block_r > 1 and triton.cdiv(n_rows, block_r) * n_dblk < cores:
            block_r //= 2
        merge_grid = (grid_size(triton.cdiv(n_rows, block_r) * n_dblk, device, cores),)
        kernel_for(_split_merge_kernel, device)[merge_grid](
            part_out, part_lse, out, lse,
            num_splits, n_rows, Hq, Dv, n_dblk,
            *part_out.stride(), *part_lse.stride(), *out.stride(), *lse.stride(),
            BLOCK_R=block_r, BLOCK_D=block_d,
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


# Dv columns of one split-merge work item (its tile: <= 16 rows x 64 columns).
_MERGE_BLOCK_D = 64


def _dot_tiles(group: int, d_max: int) -> tuple[int, int]:
    """(BLOCK_H, BLOCK_N) of the tl.dot path: the query-head group padded to >= 16 rows
    (tl.dot's minimum M; the padded rows are masked), at most 64 and fewer for wide
    heads (MLA's 576 pads to 1024), keys 64 / 32 / 16 by head width."""
    block_h = min(max(16, next_pow2(group)), 64)
    while block_h > 16 and block_h * d_max > 16384:
        block_h //= 2
    block_n = 64 if d_max <= 128 else 32 if d_max <= 256 else 16
    return block_h, block_n


# MLA tl.dot tile (docs/kernels.md "MLA decode tile"): at most 32 heads per tile, 32
# keys, 8 warps from 32 heads on. The largest tile without spills at production shapes
# on sm_90a and sm_80 (tools/aot_cuda_check.py --production): 64 heads x 32 keys at 8
# warps needs 255 registers and spills 60 bytes on sm_90a (the [64, 512] fp32
# accumulator is 128 registers a thread, the q tile in registers another 64), 16 warps
# cap a thread at 128 registers and spill more.
_MLA_BLOCK_H = 32
_MLA_BLOCK_N = 32


def _mla_dot_tiles(heads: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_N, num_warps) of the MLA tl.dot path: the rank's heads in one tile
    up to _MLA_BLOCK_H (padded to >= 16, tl.dot's minimum M), so a key tile's latent row
    is loaded once for all of them; more heads are head blocks of _MLA_BLOCK_H, which
    the work order makes neighbours in the grid (the same split's rows, read from L2 by
    all but the first). 8 warps hold a 32-head [32, 512] fp32 accumulator."""
    block_h = min(max(16, next_pow2(heads)), _MLA_BLOCK_H)
    return block_h, _MLA_BLOCK_N, 8 if block_h >= 32 else 4


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
    # The NPU's launch: unsplit, persistent (kv_splits is not asked there).
    q = torch.empty(2, 8, 128, dtype=torch.bfloat16)
    kv = torch.empty(2, 16, 1, 128, dtype=torch.bfloat16)
    yield ("GQA bf16 group 8 D 128 unsplit (NPU)",
           functools.partial(paged_attention_with_lse_triton, q, kv, kv, bt, qsl, kv_lens, 0.1, num_splits=1))
    # Split-KV launches (the CUDA default; the NPU launches above run unsplit): a table
    # wide enough (64 pages of 16) that kv_splits cuts it, the split merge after it; the
    # broadcast and the tl.dot products, GQA group 8 / 16 and MLA.
    wide = torch.zeros(1, 64, dtype=torch.int32)
    for group, use_dot in ((8, False), (8, True), (16, True), (1, True)):
        q = torch.empty(2, group, 128, dtype=torch.bfloat16)
        kv = torch.empty(64, 16, 1, 128, dtype=torch.bfloat16)
        yield (f"GQA bf16 group {group} D 128 split-KV{', tl.dot' if use_dot else ''}",
               functools.partial(paged_attention_with_lse_triton, q, kv, kv, wide, qsl, kv_lens, 0.1,
                                 use_dot=use_dot))
    for heads in (16, 128):
        q = torch.empty(2, heads, 576, dtype=torch.bfloat16)
        cache = torch.empty(64, 16, 576, dtype=torch.bfloat16)
        yield (f"MLA bf16 {heads} heads 512+64 split-KV, tl.dot",
               functools.partial(paged_attention_with_lse_triton, q, cache.unsqueeze(2), cache[..., :512].unsqueeze(2),
                                 wide, qsl, kv_lens, 0.1, use_dot=True))
    # The cube path (tests launch it; the intended MLA path on AI cores).
    q = torch.empty(2, 16, 576, dtype=torch.bfloat16)
    cache = torch.empty(2, 16, 576, dtype=torch.bfloat16)
    yield ("MLA bf16 16 heads 512+64, tl.dot",
           functools.partial(paged_attention_with_lse_triton, q, cache.unsqueeze(2), cache[..., :512].unsqueeze(2),
                             bt, qsl, kv_lens, 0.1, block_h=16, block_n=16, use_dot=True))


LOWERING = LoweringDeclaration(examples=_lowering_examples)
