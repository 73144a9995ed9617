"""Sparse (DSA) absorbed MLA over top-k indices of a paged latent cache, returning (out, lse).

One work item is (query row, block of heads); it streams the row's K indices in
BLOCK_N tiles: each index j is a request-local position read at page
`block_table[req, j // BS]`, offset `j % BS` (-1 = skip), keys [c; k_pe] in two
column groups (L and R, no padding of L + R to a power of two) and values the c
columns already loaded for the scores. Online softmax in fp32; a row with no valid
index gets out 0, lse -inf (the DCP merge weighs it 0). Serves the single-device
op, the SFA DCP partial and the DSA-CP row shard (rows given by their request).
Torch oracle: `cp_compile.ops.sparse.reference.sparse_attention_rows_with_lse`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.attention_tile import lse_epilogue, online_softmax_step, paged_location
from cp_compile.ops.core import layout
from cp_compile.ops.core.triton_cache_write import cache_write_triton
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    prev_pow2,
    require_int32_offsets,
)

_TILE_BUDGET = 8192  # elements of the broadcast [BLOCK_H, BLOCK_N, L_PAD] product (no-dot path)


@triton.jit
def _sparse_mla_kernel(
    qn_ptr, qp_ptr, kv_ptr, bt_ptr, req_ptr, idx_ptr, out_ptr, lse_ptr,
    scale,
    n_work, H, n_hblk, K, L, R, block_size,
    s_nt, s_nh, s_nd,
    s_pt, s_ph, s_pd,
    s_kb, s_ks, s_kd,
    s_bt,
    s_it, s_ik,
    s_ot, s_oh, s_od,
    s_lt, s_lh,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, L_PAD: tl.constexpr, R_PAD: tl.constexpr,
    USE_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, L_PAD)
    offs_r = tl.arange(0, R_PAD)
    l_mask = offs_l < L
    r_mask = offs_r < R
    for w in range(pid, n_work, nprog):
        t = w // n_hblk
        h = (w % n_hblk) * BLOCK_H + offs_h
        h_mask = h < H
        req = tl.load(req_ptr + t)
        n_idx = tl.where(req >= 0, K, 0)  # padding rows read no index
        req = tl.maximum(req, 0)
        qn = tl.load(qn_ptr + t * s_nt + h[:, None] * s_nh + offs_l[None, :] * s_nd,
                     mask=h_mask[:, None] & l_mask[None, :], other=0.0)
        qp = tl.load(qp_ptr + t * s_pt + h[:, None] * s_ph + offs_r[None, :] * s_pd,
                     mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        if not USE_DOT:
            qn = qn.to(tl.float32)
            qp = qp.to(tl.float32)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, L_PAD], dtype=tl.float32)
        for start in range(0, n_idx, BLOCK_N):
            kk = start + offs_n
            j = tl.load(idx_ptr + t * s_it + kk * s_ik, mask=kk < n_idx, other=-1)
            valid = j >= 0
            j = tl.where(valid, j, 0)
            page, in_page = paged_location(bt_ptr, req, s_bt, j, valid, block_size)
            row = page * s_kb + in_page * s_ks  # [BLOCK_N]
            kc = tl.load(kv_ptr + row[:, None] + offs_l[None, :] * s_kd,
                         mask=valid[:, None] & l_mask[None, :], other=0.0)  # [BLOCK_N, L_PAD]: keys and values
            kp = tl.load(kv_ptr + row[:, None] + (L + offs_r[None, :]) * s_kd,
                         mask=valid[:, None] & r_mask[None, :], other=0.0)
            if USE_DOT:
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
        tl.store(out_ptr + t * s_ot + h[:, None] * s_oh + offs_l[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & l_mask[None, :])
        tl.store(lse_ptr + t * s_lt + h * s_lh, lse, mask=h_mask)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> out [T, H, L] in q_nope.dtype, lse [T, H] fp32 (semantics of the reference).
    use_dot: tl.dot products (default on accelerators; needs block_h, block_n >= 16)."""
    T, H, L = q_nope.shape
    R = q_pe.shape[-1]
    if kv_cache.shape[-1] != L + R or q_pe.shape[:2] != (T, H) or indices.shape[0] != T:
        raise ValueError(f"q_nope {tuple(q_nope.shape)}, q_pe {tuple(q_pe.shape)}, kv_cache "
                         f"{tuple(kv_cache.shape)}, indices {tuple(indices.shape)} do not fit")
    device = q_nope.device
    out = torch.empty(T, H, L, dtype=q_nope.dtype, device=device)
    lse = torch.empty(T, H, dtype=torch.float32, device=device)
    K = indices.shape[1]
    if T == 0:
        return out, lse
    if K == 0 or block_table.shape[0] == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    require_int32_offsets(q_nope=q_nope, q_pe=q_pe, kv_cache=kv_cache, block_table=block_table, out=out)
    use_dot = device.type != "cpu" if use_dot is None else use_dot
    l_pad, r_pad = next_pow2(L), next_pow2(R)
    if use_dot:
        l_pad, r_pad = max(l_pad, 16), max(r_pad, 16)
        block_h, block_n = block_h or 16, block_n or (32 if l_pad <= 512 else 16)
    else:
        block_h = block_h or max(1, min(next_pow2(H), prev_pow2(_TILE_BUDGET // (8 * l_pad))))
        block_n = block_n or max(8, min(64, prev_pow2(_TILE_BUDGET // (block_h * l_pad))))
    if block_h & (block_h - 1) or block_n & (block_n - 1):
        raise ValueError(f"block_h={block_h} and block_n={block_n} must be powers of two")
    n_hblk = triton.cdiv(H, block_h)
    req = req.to(device=device, dtype=torch.int32).contiguous()
    block_table = block_table.to(torch.int32).contiguous()
    indices = indices.to(torch.int32)
    n_work = T * n_hblk
    grid = (grid_size(n_work, device, num_programs, uses_cube=use_dot),)
    kernel_for(_sparse_mla_kernel, device)[grid](
        q_nope, q_pe, kv_cache, block_table, req, indices, out, lse, float(scale),
        n_work, H, n_hblk, K, L, R, kv_cache.shape[1],
        *q_nope.stride(), *q_pe.stride(), *kv_cache.stride(), block_table.stride(0), *indices.stride(),
        *out.stride(), *lse.stride(),
        BLOCK_H=block_h, BLOCK_N=block_n, L_PAD=l_pad, R_PAD=r_pad, USE_DOT=use_dot,
    )
    return out, lse


# ----------------------------------------------------------------------------- the ops' device kernels


def sparse_mla_partial_attention_device(q_nope, q_pe, kv_cache, block_table, query_start_loc, indices, scale):
    """`cp::sparse_mla_partial_attention` on an accelerator."""
    req = layout.request_index(query_start_loc, q_nope.shape[0])
    return sparse_mla_rows_triton(q_nope, q_pe, kv_cache, block_table, req, indices, scale)


def sparse_mla_rows_attention_device(q_nope, q_pe, kv_cache, block_table, seq_lens, query_start_loc, indices, tp,
                                     rank, scale):
    """`cp::sparse_mla_rows_attention` (DSA-CP row shard) on an accelerator."""
    req, _ = layout.shard_row_metadata(query_start_loc, seq_lens, q_nope.shape[0], tp=tp, rank=rank)
    return sparse_mla_rows_triton(q_nope, q_pe, kv_cache, block_table, req, indices, scale)[0]


def sparse_mla_attention_device(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                                query_start_loc, topk_indices, scale):
    """`cp::sparse_mla_attention` on an accelerator: latent write, then sparse attention."""
    cache_write_triton(torch.cat([kv_c, k_pe], dim=-1), kv_cache, slot_mapping)
    return sparse_mla_partial_attention_device(q_nope, q_pe, kv_cache, block_table, query_start_loc, topk_indices,
                                               scale)[0]


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
    qn, qp = torch.empty(2, 16, 512, dtype=torch.bfloat16), torch.empty(2, 16, 64, dtype=torch.bfloat16)
    yield "partial op", functools.partial(sparse_mla_partial_attention_device, qn, qp, cache, bt, qsl, idx, 0.1)


LOWERING = LoweringDeclaration(examples=_lowering_examples)
