"""Lightning-indexer scores (DeepSeek-V3.2 DSA) over a paged index cache, then an on-device top-k.

Scores: one work item is (query row, key split): the static width S =
block_table.shape[1] * BS (a shape, not a data-dependent length: nothing is read back
to the host) is cut into `n_splits` ranges of `split_len` keys, and an item loads its
row's q [Hi, Di] and weights once, then streams its range in BLOCK_N-key tiles:
I[t, j] = sum_h w[t, h] * relu(q[t, h] . k[j]) in fp32 (tl.dot over the heads on
accelerators) for the row's causal keys j < kv_lens[t], -inf for the rest. Each score
belongs to one split, so there is no merge. CUDA: enough splits for 2 waves of the
SMs (`kv_splits` with splits of >= 64 keys), one program per item; NPU: one BLOCK_N tile per item
on its persistent per-core grid (the launch it had; docs/decisions.md 58). Top-k: a
stable descending `torch.sort` on the device, so ties go to the lower position exactly
as in the reference, and positions past kv_lens become -1. Rows are scored in chunks
that bound the [rows, S] score buffer (a Python loop over shapes, which a CUDA graph
captures). Torch oracle: `cp_compile.ops.sparse.reference.lightning_indexer_topk_rows`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.attention_tile import paged_location
from cp_compile.ops.core import layout
from cp_compile.ops.core.split_kv import kv_splits
from cp_compile.ops.core.triton_cache_write import cache_write_triton
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    prev_pow2,
    require_int32_offsets,
    target_of,
)

_TILE_BUDGET = 8192  # elements of the broadcast [HI_PAD, BLOCK_N, D_PAD] product (no-dot path)
_CHUNK_ELEMS = 1 << 26  # fp32 scores held at once (256 MiB)
# Shortest key split worth a program: each item loads its row's q [64, 128] (16 KB, the
# bytes of 63 keys of 128 bf16; an L2 hit after the row's first item) once, so shorter
# splits would spend more on q than on keys (docs/kernels.md "Split-KV sparse MLA and the
# lightning indexer": 64 predicts at least as well as 128 / 256 / 512 at every plan shape).
_MIN_SPLIT = 64


@triton.jit
def _index_scores_kernel(
    q_ptr, k_ptr, w_ptr, bt_ptr, req_ptr, kvlen_ptr, out_ptr,
    n_work, n_splits, split_len, Hi, Di, block_size, S,
    s_qt, s_qh, s_qd,
    s_kb, s_ks, s_kd,
    s_wt, s_wh,
    s_bt,
    s_ot,
    HI_PAD: tl.constexpr, BLOCK_N: tl.constexpr, D_PAD: tl.constexpr, USE_DOT: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_h = tl.arange(0, HI_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    h_mask = offs_h < Hi
    d_mask = offs_d < Di
    for w in range(pid, n_work, nprog):
        t = w // n_splits
        lo = (w % n_splits) * split_len
        hi = tl.minimum(lo + split_len, S)  # this split's keys (need not align to BLOCK_N)
        req = tl.load(req_ptr + t)
        n_kv = tl.load(kvlen_ptr + t)
        n_kv = tl.where(req >= 0, n_kv, 0)
        req = tl.maximum(req, 0)
        # The row's query and weights once per item, not once per key tile.
        q = tl.load(q_ptr + t * s_qt + offs_h[:, None] * s_qh + offs_d[None, :] * s_qd,
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)  # [HI_PAD, D_PAD]
        if not USE_DOT:
            q = q.to(tl.float32)
        wt = tl.load(w_ptr + t * s_wt + offs_h * s_wh, mask=h_mask, other=0.0).to(tl.float32)
        for start in range(lo, hi, BLOCK_N):
            j = start + offs_n  # request-local positions
            valid = j < tl.minimum(n_kv, hi)
            page, in_page = paged_location(bt_ptr, req, s_bt, j, valid, block_size)
            k = tl.load(k_ptr + (page * s_kb + in_page * s_ks)[:, None] + offs_d[None, :] * s_kd,
                        mask=valid[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_N, D_PAD]
            if USE_DOT:
                dots = tl.dot(q, tl.trans(k))  # [HI_PAD, BLOCK_N] fp32: every head in one product
            else:
                dots = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            score = tl.sum(wt[:, None] * tl.maximum(dots, 0.0), axis=0)  # [BLOCK_N]
            tl.store(out_ptr + t * s_ot + j, tl.where(valid, score, float("-inf")), mask=j < hi)


def index_scores_triton(
    q_i: torch.Tensor,  # [T, Hi, Di]
    index_cache: torch.Tensor,  # [NB, BS, Di]
    w: torch.Tensor,  # [T, Hi]
    block_table: torch.Tensor,  # [B, nb]
    req: torch.Tensor,  # [T] request of each row, -1 = padding row
    kv_lens: torch.Tensor,  # [T] causal key count of each row
    *,
    num_programs: int | None = None,
    block_n: int | None = None,
    use_dot: bool | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """-> fp32 [T, S] scores, S = block_table.shape[1] * BS; -inf past each row's kv_lens.

    num_splits: key ranges per row, one work item each (default: `kv_splits` with splits of >= _MIN_SPLIT keys on CUDA and
    under the interpreter, one BLOCK_N tile per item on the NPU); any value >= 1 is
    accepted (tests: splits ending mid-tile, splits past every row's kv_len)."""
    T, Hi, Di = q_i.shape
    BS = index_cache.shape[1]
    S = block_table.shape[1] * BS
    device = q_i.device
    out = torch.empty(T, S, dtype=torch.float32, device=device)
    if T == 0 or S == 0:
        return out
    require_int32_offsets(q_i=q_i, index_cache=index_cache, block_table=block_table, out=out)
    target = target_of(device)[0]  # the tensors' device, or the one a plan targets
    use_dot = target != "cpu" if use_dot is None else use_dot
    cores = target_of(device, uses_cube=use_dot)[1]
    hi_pad, d_pad = next_pow2(Hi), next_pow2(Di)
    if use_dot:
        hi_pad, d_pad = max(hi_pad, 16), max(d_pad, 16)
        # CUDA: 32 keys, the tile with no spill at 64 heads x 128 on sm_80 and sm_90a (64
        # spilled 4 bytes on sm_80 once q stays in registers across the tiles); the NPU
        # keeps its 64-key items.
        block_n = block_n or (64 if target == "npu" else 32)
    else:
        # >= 8 keys: a [HI_PAD, 1, D_PAD] product does not lower through triton-ascend's adapter.
        block_n = block_n or max(8, min(64, prev_pow2(_TILE_BUDGET // (hi_pad * d_pad))))
    if block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n} must be a power of two")
    if num_splits is None:
        if target == "npu":
            num_splits, split_len = triton.cdiv(S, block_n), block_n  # one tile per item, as before the splits
        else:
            num_splits, split_len = kv_splits(T, S, cores, min_split=_MIN_SPLIT)
    elif num_splits >= 1:
        split_len = triton.cdiv(S, num_splits)
    else:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    n_work = T * num_splits
    if num_programs is None:
        num_programs = n_work if target == "cuda" else cores
    grid = (grid_size(n_work, device, num_programs),)
    kernel_for(_index_scores_kernel, device)[grid](
        q_i, index_cache, w, block_table.to(torch.int32).contiguous(), req.to(device=device, dtype=torch.int32),
        kv_lens.to(device=device, dtype=torch.int32).contiguous(), out,
        n_work, num_splits, split_len, Hi, Di, BS, S,
        *q_i.stride(), *index_cache.stride(), *w.stride(), block_table.stride(0), out.stride(0),
        HI_PAD=hi_pad, BLOCK_N=block_n, D_PAD=d_pad, USE_DOT=use_dot,
    )
    return out


def indexer_topk_rows(q_i: torch.Tensor, index_cache: torch.Tensor, w: torch.Tensor, block_table: torch.Tensor,
                      req: torch.Tensor, kv_lens: torch.Tensor, topk: int, **kernel_options) -> torch.Tensor:
    """Device twin of `reference.lightning_indexer_topk_rows` -> int32 [T, topk] (-1 padded)."""
    T = q_i.shape[0]
    S = block_table.shape[1] * index_cache.shape[1]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q_i.device)
    keep = min(topk, S)
    if T == 0 or keep == 0:
        return out
    kv_lens = kv_lens.to(device=q_i.device, dtype=torch.int32)
    rows = max(1, _CHUNK_ELEMS // S)
    for r0 in range(0, T, rows):  # shapes only: the same chunks on every step of this shape
        r1 = min(T, r0 + rows)
        s = index_scores_triton(q_i[r0:r1], index_cache, w[r0:r1], block_table, req[r0:r1], kv_lens[r0:r1],
                                **kernel_options)
        # Stable: equal scores keep ascending positions, as the reference's sort does.
        idx = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :keep]
        idx = torch.where(idx < kv_lens[r0:r1, None], idx, torch.full_like(idx, -1))
        out[r0:r1, :keep] = idx.to(torch.int32)
    return out


# ----------------------------------------------------------------------------- the ops' device kernels


def lightning_indexer_device(q_i, k_i, w, index_cache, slot_mapping, block_table, seq_lens, query_start_loc, topk):
    """`cp::lightning_indexer` on an accelerator: index-key write, then scores and top-k."""
    cache_write_triton(k_i, index_cache, slot_mapping)
    T = q_i.shape[0]
    req = layout.request_index(query_start_loc, T)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, T)
    return indexer_topk_rows(q_i, index_cache, w, block_table, req, kv_lens, topk)


def lightning_indexer_topk_rows_device(q_i, index_cache, w, block_table, seq_lens, query_start_loc, tp, rank, topk):
    """`cp::lightning_indexer_topk_rows` (DSA-CP row shard) on an accelerator."""
    req, kv_lens = layout.shard_row_metadata(query_start_loc, seq_lens, q_i.shape[0], tp=tp, rank=rank)
    return indexer_topk_rows(q_i, index_cache, w, block_table, req, kv_lens, topk)


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    # DeepSeek-V3.2 indexer: 64 heads of 128 on the tl.dot path (what accelerators launch),
    # fp32 / bf16; the broadcast path (CPU default) at a small indexer.
    bt = torch.zeros(1, 2, dtype=torch.int32)
    req = torch.zeros(2, dtype=torch.int32)
    kv = torch.ones(2, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        for (hi, di), use_dot in (((64, 128), True), ((8, 64), False)):
            q, cache = torch.empty(2, hi, di, dtype=dtype), torch.empty(2, 64, di, dtype=dtype)
            yield (f"{str(dtype)[6:]} {hi} x {di} dot={use_dot}",
                   functools.partial(index_scores_triton, q, cache, torch.empty(2, hi, dtype=dtype), bt, req, kv,
                                     use_dot=use_dot))
    # The NPU's launch: 64-key items (one tile each) on the persistent grid.
    q, cache = torch.empty(2, 64, 128, dtype=torch.bfloat16), torch.empty(2, 64, 128, dtype=torch.bfloat16)
    yield ("bf16 64 x 128 dot=True, the NPU's 64-key tiles",
           functools.partial(index_scores_triton, q, cache, torch.empty(2, 64, dtype=torch.bfloat16), bt, req, kv,
                             use_dot=True, block_n=64, num_splits=2))
    # A split launch at a production width (32k keys: several 64+-key splits per row).
    wide = torch.zeros(1, 512, dtype=torch.int32)
    yield ("bf16 64 x 128 dot=True, 32k keys split",
           functools.partial(index_scores_triton, q, cache, torch.empty(2, 64, dtype=torch.bfloat16), wide, req, kv,
                             use_dot=True))


LOWERING = LoweringDeclaration(examples=_lowering_examples)
