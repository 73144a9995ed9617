"""Sparse (DSA) absorbed MLA over top-k indices of a paged latent cache, returning (out, lse).

One work item is (query row, KV split, block of heads), the head block innermost so the
head blocks of one (row, split) read the same latent rows at the same time (L2). The
row's K indices (a shape: the index list's width) are cut into `n_splits` ranges of
`split_len`; an item streams its range in BLOCK_N tiles: each index j is a
request-local position read at page `block_table[req, j // BS]`, offset `j % BS`
(-1 = skip), keys [c; k_pe] in two column groups (L and R: two products, no padding of
L + R to a power of two) and values the c columns already loaded for the scores.
Online softmax in fp32; a range with no valid index gets out 0, lse -inf (decision
47). With more than one split (CUDA, the interpreter) each split writes an fp32
partial and `triton_split_merge.merge_splits_triton` merges them by LSE; the NPU
launches one split on its persistent per-core grid (docs/decisions.md 54, 58).
Serves the single-device op, the SFA DCP partial and the DSA-CP row shard (rows given
by their request). Torch oracle: `cp_compile.ops.sparse.reference.sparse_attention_rows_with_lse`.

A quantised latent (int8 / fp8, issue 39) is dequantised on load (`QUANT`): right after a
tile's [c; k_pe] rows are loaded, each row is multiplied by its token's fp32 scale (the
scale cache [NB, BS, 1] beside the pages), and the tile goes on in fp32 (in q's dtype on the
tl.dot path). The split partials are fp32 whatever the cache holds, so the merge is unchanged.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.attention_tile import lse_epilogue, online_softmax_step, paged_location
from cp_compile.ops.core import kv_quant, layout
from cp_compile.ops.core.triton_cache_write import cache_write_device
from cp_compile.ops.core.split_kv import kv_splits
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    prev_pow2,
    require_int32_offsets,
    target_of,
)
from cp_compile.ops.sparse.triton_split_merge import merge_splits_triton

_TILE_BUDGET = 8192  # elements of the broadcast [BLOCK_H, BLOCK_N, L_PAD] product (no-dot path)


@triton.jit
def _sparse_mla_kernel(
    qn_ptr, qp_ptr, kv_ptr, bt_ptr, req_ptr, idx_ptr, out_ptr, lse_ptr,
    scale,
    n_work, H, n_hblk, n_splits, split_len, K, L, R, block_size,
    s_nt, s_nh, s_nd,
    s_pt, s_ph, s_pd,
    s_kb, s_ks, s_kd,
    s_bt,
    s_it, s_ik,
    s_os, s_ot, s_oh, s_od,
    s_ls, s_lt, s_lh,
    ks_ptr, s_ksb, s_kss,  # a quantised latent's scales [NB, BS] (read only when QUANT)
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
    USE_DOT: tl.constexpr, QUANT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    l_mask = offs_l < L
    r_mask = offs_r < R
    # Persistent loop (NPU: grid <= cores, one split; CUDA: one program per item).
    for w in range(pid, n_work, nprog):
        hb = w % n_hblk  # innermost: a (row, split)'s head blocks run side by side
        w2 = w // n_hblk
        sp = w2 % n_splits
        t = w2 // n_splits
        h = hb * BLOCK_H + offs_h
        h_mask = h < H
        req = tl.load(req_ptr + t)
        n_idx = tl.where(req >= 0, K, 0)  # padding rows read no index
        req = tl.maximum(req, 0)
        # This split's entries of the index list; a range need not align to BLOCK_N (the
        # last tile is masked at hi) and one past K is empty (no tile: out 0, lse -inf).
        lo = sp * split_len
        hi = tl.minimum(lo + split_len, n_idx)
        qn = tl.load(qn_ptr + t * s_nt + h[:, None] * s_nh + offs_l[None, :] * s_nd,
                     mask=h_mask[:, None] & l_mask[None, :], other=0.0)  # [BLOCK_H, L_PAD]
        qp = tl.load(qp_ptr + t * s_pt + h[:, None] * s_ph + offs_r[None, :] * s_pd,
                     mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, R_PAD]
        if not USE_DOT:
            qn = qn.to(tl.float32)
            qp = qp.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
        for start in range(lo, hi, BLOCK_N):
            kk = start + offs_n
            j = tl.load(idx_ptr + t * s_it + kk * s_ik, mask=kk < hi, other=-1)
            valid = j >= 0
            j = tl.where(valid, j, 0)
            page, in_page = paged_location(bt_ptr, req, s_bt, j, valid, block_size)
            row = page * s_kb + in_page * s_ks  # [BLOCK_N]
            kc = tl.load(kv_ptr + row[:, None] + offs_l[None, :] * s_kd,
                         mask=valid[:, None] & l_mask[None, :], other=0.0)  # [BLOCK_N, L_PAD]: keys and values
            kp = tl.load(kv_ptr + row[:, None] + (L + offs_r[None, :]) * s_kd,
                         mask=valid[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_N, R_PAD]
            if QUANT:  # dequantise on load (issue 39): codes * the token's scale, fp32
                sc = tl.load(ks_ptr + page * s_ksb + in_page * s_kss, mask=valid, other=0.0)  # [BLOCK_N]
                kc = kc.to(tl.float32) * sc[:, None]
                kp = kp.to(tl.float32) * sc[:, None]
                if USE_DOT:  # tl.dot takes both operands in q's dtype
                    kc = kc.to(qn_ptr.dtype.element_ty)
                    kp = kp.to(qn_ptr.dtype.element_ty)
            if USE_DOT:
                # All heads of the block as the M side: latent and rope as two products.
                s = tl.dot(qn, tl.trans(kc)) + tl.dot(qp, tl.trans(kp))
            else:
                s = (tl.sum(qn[:, None, :] * kc.to(tl.float32)[None, :, :], axis=2)
                     + tl.sum(qp[:, None, :] * kp.to(tl.float32)[None, :, :], axis=2))
            s = tl.where(valid[None, :], s * scale, float("-inf"))  # [BLOCK_H, BLOCK_N]
            # a tile of skipped indices only leaves the row at 0 (the helper's shift)
            p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
            if USE_DOT:
                pv = tl.dot(p.to(kc.dtype), kc)
            else:
                pv = tl.sum(p[:, :, None] * kc.to(tl.float32)[None, :, :], axis=1)
            acc = acc * alpha[:, None] + pv
        out, lse = lse_epilogue(acc, l_i, m_i)
        tl.store(out_ptr + sp * s_os + t * s_ot + h[:, None] * s_oh + offs_l[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])
        tl.store(lse_ptr + sp * s_ls + t * s_lt + h * s_lh, lse, mask=h_mask)


def sparse_mla_rows_triton(
    q_nope: torch.Tensor,  # [T, H, L]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_cache: torch.Tensor,  # [NB, BS, L+R]
    block_table: torch.Tensor,  # [B, nb]
    req: torch.Tensor,  # [T] request of each row, -1 = padding row
    indices: torch.Tensor,  # [T, K] request-local positions, -1 = skip
    scale: float,
    *,
    num_programs: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    kv_scale_cache: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out [T, H, L] in q_nope.dtype, lse [T, H] fp32 (semantics of the reference).

    kv_scale_cache: [NB, BS, 1] fp32, the per-token scales of a quantised (int8 / fp8)
    kv_cache, dequantised on load; None for a cache in the model's dtype.

    use_dot: tl.dot products (default on accelerators; needs block_h, block_n >= 16):
    the heads of the rank in tiles of 16 (all of them at 16 heads; a [32, 512] fp32
    accumulator would not fit the registers of a 4-warp program), 16 indices a tile.
    num_splits: ranges of the index list, each a work item writing an fp32 partial,
    merged by LSE after (docs/decisions.md 58). Default: from the index list's width and
    the core count only (`kv_splits`: >= 2 waves of items, splits of >= 16 indices) on CUDA and under the interpreter; 1 on the NPU (its persistent per-core
    grid, no partials). Any value >= 1 is accepted (tests: splits ending mid-tile, empty).
    num_programs: persistent grid size (default: CUDA one program per item, else cores).
    """
    T, H, L = q_nope.shape
    R = q_pe.shape[-1]
    if kv_cache.shape[-1] != L + R or q_pe.shape[:2] != (T, H) or indices.shape[0] != T:
        raise ValueError(f"q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, kv_cache "
                         f"{tuple(kv_cache.shape)}, indices {tuple(indices.shape)} do not fit")
    kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")
    device = q_nope.device
    out = torch.empty(T, H, L, dtype=q_nope.dtype, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    K = indices.shape[1]
    if T == 0:
        return out, lse
    if K == 0 or block_table.shape[0] == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    require_int32_offsets(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table, out=out)
    target = target_of(device)[0]  # the tensors' device, or the one a plan targets
    use_dot = target != "cpu" if use_dot is None else use_dot
    cores = target_of(device, uses_cube=use_dot)[1]
    l_pad, r_pad = next_pow2(L), next_pow2(R)
    warps = 4  # Triton's default
    if use_dot:
        l_pad, r_pad = max(l_pad, 16), max(r_pad, 16)
        block_h = block_h or min(max(16, next_pow2(H)), 16 if l_pad >= 256 else 64)
        wide = l_pad >= 256  # MLA's 512 latent columns
        # CUDA, 512 latent: 16 heads x 32 indices at 8 warps (as the paged MLA decode tile
        # from 32 heads): 0 spills at every production launch on sm_80 and sm_90a, 128-184
        # registers (tools/aot_cuda_check.py --production, docs/kernels_aot.md). At 4 warps
        # 16 x 16 spills 12 B on sm_80, and 16 x 32 needs 255 registers on sm_80, the cap
        # (no headroom before a spill); 16 x 16 at 8 warps spills 4 / 16 B. The NPU keeps
        # 16 indices (it takes no num_warps).
        block_n = block_n or (16 if wide and target != "cuda" else 32)
        warps = 8 if wide else 4
    else:
        block_h = block_h or max(1, min(next_pow2(H), prev_pow2(_TILE_BUDGET // (8 * l_pad))))
        block_n = block_n or max(8, min(64, prev_pow2(_TILE_BUDGET // (block_h * l_pad))))
    if block_h & (block_h - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_h={block_h} and block_n={block_n} must be powers of two")
    n_hblk = triton.cdiv(H, block_h)
    n_items = T * n_hblk
    if num_splits is None:
        if target == "npu":
            num_splits, split_len = 1, K
        else:
            num_splits, split_len = kv_splits(n_items, K, cores)
    elif num_splits >= 1:
        split_len = triton.cdiv(K, num_splits)
    else:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if num_splits == 1:
        split_len = K
    req = req.to(device=device, dtype=torch.int32).contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    indices = indices.to(torch.int32)
    n_work = n_items * num_splits
    if num_programs is None:
        num_programs = n_work if target == "cuda" else cores
    grid = (grid_size(n_work, device, num_programs),)
    if num_splits == 1:
        part_out, part_lse, s_po, s_pl = out, lse, 0, 0  # written directly, no merge
    else:
        part_out = torch.empty(num_splits, T, H, L, dtype=torch.float32, device=device)  # [S, T, H, L]
        part_lse = torch.empty(num_splits, T, H, dtype=torch.float32, device=device)  # [S, T, H]
        require_int32_offsets(part_out=part_out)
        s_po, s_pl = part_out.stride(0), part_lse.stride(0)
    quant = kv_scale_cache is not None
    if quant:
        ks = kv_quant.scale_view(kv_cache, kv_scale_cache)  # [NB, BS]
        require_int32_offsets(kv_scale_cache=ks)
        scale_strides = tuple(ks.stride())
    else:
        ks, scale_strides = lse, (0, 0)  # never read (QUANT=False): any pointer
    kernel_for(_sparse_mla_kernel, device)[grid](
        q_nope, q_pe, kv_cache, block_table, req, indices, part_out, part_lse, float(scale),
        n_work, H, n_hblk, num_splits, split_len, K, L, R, kv_cache.shape[1],
        *q_nope.stride(), *q_pe.stride(), *kv_cache.stride(), block_table.stride(0), *indices.stride(),
        s_po, *part_out.stride()[-3:], s_pl, *part_lse.stride()[-2:],
        ks, *scale_strides,
        BLOCK_H=block_h, BLOCK_N=block_n, L_PAD=l_pad, R_PAD=r_pad, USE_DOT=use_dot, QUANT=quant,
        **({"num_warps": num_warps or warps} if target == "cuda" else {}),
    )
    if num_splits > 1:
        merge_splits_triton(part_out, part_lse, out, lse)
    return out, lse


# ----------------------------------------------------------------------------- the ops' device kernels


def _refuse_fp8(op: str, kv_cache: torch.Tensor) -> None:
    # triton-ascend has no fp8 type (the lowering check fails such a kernel at TTIR), and no NPU
    # attention reads fp8 keys (decision 70): refused by name, never read as another dtype.
    if kv_cache.dtype != torch.int8:
        raise NotImplementedError(
            f"{op}: on the NPU the quantised sparse MLA kernel (triton-ascend) takes an int8 latent, and this "
            f"cache is {kv_cache.dtype} (triton-ascend has no fp8 type). Fix: CPConfig(kv_cache_dtype='int8') on "
            "the NPU, or run the fp8 cache on CPU / CUDA (Triton)")


def _refuse_quantized_on_npu(op: str, device: torch.device, kv_cache: torch.Tensor, kv_scale_cache) -> None:
    # The ops' NPU entry is this kernel through triton-ascend: its int8 QUANT launches are in the
    # lowering check (they reach linalg, decision 75); fp8 has no type there.
    if kv_scale_cache is not None and target_of(device)[0] == "npu":
        _refuse_fp8(op, kv_cache)


def sparse_mla_partial_attention_device(q_nope, q_pe, kv_cache, block_table, query_start_loc, indices, scale,
                                        kv_scale_cache=None):
    """`cp::sparse_mla_partial_attention` on an accelerator."""
    _refuse_quantized_on_npu("cp::sparse_mla_partial_attention", q_nope.device, kv_cache, kv_scale_cache)
    req = layout.request_index(query_start_loc, q_nope.shape[0])
    return sparse_mla_rows_triton(q_nope, q_pe, kv_cache, block_table, req, indices, scale,
                                  kv_scale_cache=kv_scale_cache)


def sparse_mla_rows_attention_device(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, indices, tp,
                                     rank, scale, kv_scale_cache=None):
    """`cp::sparse_mla_rows_attention` (DSA-CP row shard) on an accelerator."""
    _refuse_quantized_on_npu("cp::sparse_mla_rows_attention", q_nope.device, kv_cache, kv_scale_cache)
    req, _ = layout.shard_row_metadata(query_start_loc, seq_lens, q_nope.shape[0], tp=tp, rank=rank)
    return sparse_mla_rows_triton(q_nope, q_pe, kv_cache, block_table, req, indices, scale,
                                  kv_scale_cache=kv_scale_cache)[0]


def sparse_mla_attention_device(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                                query_start_loc, topk_indices, scale):
    """`cp::sparse_mla_attention` on an accelerator: latent write, then sparse attention."""
    cache_write_device(torch.cat([kv_c, k_pe], dim=-1), kv_cache, slot_mapping)
    return sparse_mla_partial_attention_device(q_nope, q_pe, kv_cache, block_table, query_start_loc, topk_indices,
                                               scale)[0]


def sparse_mla_attention_quant_device(q_nope, q_pe, kv_c, k_pe, kv_cache, kv_scale_cache, slot_mapping, block_table,
                                      seq_lens, query_start_loc, topk_indices, scale):
    """`cp::sparse_mla_attention_quant` on CUDA: quantising latent write (codes and scales),
    then sparse attention dequantising on load."""
    kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")  # before anything is written
    cache_write_device(torch.cat([kv_c, k_pe], dim=-1), kv_cache, slot_mapping, kv_scale_cache)
    req = layout.request_index(query_start_loc, q_nope.shape[0])
    return sparse_mla_rows_triton(q_nope, q_pe, kv_cache, block_table, req, topk_indices, scale,
                                  kv_scale_cache=kv_scale_cache)[0]


def sparse_mla_attention_quant_npu(q_nope, q_pe, kv_c, k_pe, kv_cache, kv_scale_cache, slot_mapping, block_table,
                                   seq_lens, query_start_loc, topk_indices, scale):
    """`cp::sparse_mla_attention_quant` on the NPU (int8): the write through the op
    `cp::quant_cache_write` (its NPU kernel is torch_npu's, ops/paged/npu.py: the Triton write
    aborts in triton-adapter-opt, decision 70; called as an op, the families import nothing of
    each other), then this kernel (QUANT, through triton-ascend) dequantising on load."""
    op = "cp::sparse_mla_attention_quant"
    _refuse_fp8(op, kv_cache)  # before anything is written
    kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")
    torch.ops.cp.quant_cache_write(torch.cat([kv_c, k_pe], dim=-1), kv_cache, kv_scale_cache, slot_mapping)
    req = layout.request_index(query_start_loc, q_nope.shape[0])
    return sparse_mla_rows_triton(q_nope, q_pe, kv_cache, block_table, req, topk_indices, scale,
                                  kv_scale_cache=kv_scale_cache)[0]


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    # DeepSeek-V3.2: latent 512 + rope 64, top-k 2048, 128 heads over tp 1 .. 8 (16 .. 128 local heads).
    bt = torch.zeros(1, 2, dtype=torch.int32)
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    idx = torch.zeros(2, 64, dtype=torch.int32)
    cache = torch.empty(2, 64, 576, dtype=torch.bfloat16)
    for heads in (16, 128):
        qn, qp = torch.empty(2, heads, 512, dtype=torch.bfloat16), torch.empty(2, heads, 64, dtype=torch.bfloat16)
        for use_dot in (False, True):
            yield (f"bf16 {heads} heads 512+64 dot={use_dot}",
                   functools.partial(sparse_mla_rows_triton, qn, qp, cache, bt, torch.zeros(2, dtype=torch.int32),
                                     idx, 0.1, use_dot=use_dot))
    # Split launches (the CUDA default at top-2048: kv_splits cuts the list, the merge
    # after it): tl.dot at 16 and 128 heads (the tiles CUDA launches), the broadcast product.
    top = torch.zeros(2, 2048, dtype=torch.int32)
    for heads, use_dot in ((16, True), (128, True), (16, False)):
        qn, qp = torch.empty(2, heads, 512, dtype=torch.bfloat16), torch.empty(2, heads, 64, dtype=torch.bfloat16)
        yield (f"bf16 {heads} heads 512+64 top-2048 split dot={use_dot}",
               functools.partial(sparse_mla_rows_triton, qn, qp, cache, bt, torch.zeros(2, dtype=torch.int32),
                                 top, 0.1, use_dot=use_dot))
    qn, qp = torch.empty(2, 16, 512, dtype=torch.bfloat16), torch.empty(2, 16, 64, dtype=torch.bfloat16)
    yield "partial op", functools.partial(sparse_mla_partial_attention_device, qn, qp, cache, bt, qsl, idx, 0.1)
    # An int8 latent (issue 39, decision 75): QUANT=1, each [c; k_pe] tile dequantised after its
    # load. fp8 is not listed: triton-ascend has no fp8 type (the NPU entries refuse it by name).
    codes = torch.empty(2, 64, 576, dtype=torch.int8)
    scales = torch.empty(2, 64, 1, dtype=torch.float32)
    for heads, use_dot, ind in ((16, False, idx), (16, True, idx), (128, True, top)):
        qn, qp = torch.empty(2, heads, 512, dtype=torch.bfloat16), torch.empty(2, heads, 64, dtype=torch.bfloat16)
        yield (f"int8 latent {heads} heads top-{ind.shape[1]} dot={use_dot}",
               functools.partial(sparse_mla_rows_triton, qn, qp, codes, bt, torch.zeros(2, dtype=torch.int32), ind,
                                 0.1, use_dot=use_dot, kv_scale_cache=scales))


LOWERING = LoweringDeclaration(examples=_lowering_examples)
