"""Second stage of the sparse family's split launches: the LSE merge of per-split partials.

`triton_sparse_mla.py` cuts each row's selected-token list into splits, each writing an
fp32 partial (out [S, T, H, Dv], lse [S, T, H]); this kernel merges them by LSE into
out [T, H, Dv] (the output dtype) and lse [T, H]: out = sum_s out_s exp(lse_s - LSE),
LSE = logsumexp_s lse_s. The math is `lse_merge_rows` of ops/core/attention_tile.py,
the one LSE merge ops/merge's kernels and the paged split decode also call (decision
60), with decision 47's rules in it: a split with lse -inf is empty (weight 0, its out
is not read into the sum), an all-empty row is out 0 / lse -inf, a NaN or +inf partial
LSE makes its row NaN. A kernel of this family's own because ops/sparse may not import
ops/paged (independent families, pyproject's layers): only the helper is shared.

Work items are (block of BLOCK_R rows, BLOCK_D columns of Dv): a decode step has few
(token, head) rows, and the columns are what spreads the partials over the cores.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.attention_tile import lse_merge_rows
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    target_of,
)

MERGE_BLOCK_D = 64  # Dv columns of one work item
MERGE_BLOCK_R = 16  # most rows of one work item


@triton.jit
def _sparse_split_merge_kernel(
    po_ptr, pl_ptr, out_ptr, lse_ptr,
    n_splits, n_rows, Dv, n_dblk,
    s_ps, s_pr, s_pd,
    s_ls, s_lr,
    s_or, s_od,
    s_lo,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_r = tl.arange(0, BLOCK_R)
    n_blocks = (n_rows + BLOCK_R - 1) // BLOCK_R * n_dblk
    for wi in range(pid, n_blocks, nprog):
        cb = wi % n_dblk
        r = (wi // n_dblk) * BLOCK_R + offs_r  # flattened (token, head) rows
        r_mask = r < n_rows
        offs_d = cb * BLOCK_D + tl.arange(0, BLOCK_D)
        d_mask = offs_d < Dv
        tile_mask = r_mask[:, None] & d_mask[None, :]
        res, lse = lse_merge_rows(po_ptr, pl_ptr, r * s_pr, r * s_lr, offs_d * s_pd, s_ps, s_ls, n_splits,
                                  r_mask, tile_mask, BLOCK_R, BLOCK_D)
        tl.store(out_ptr + r[:, None] * s_or + offs_d[None, :] * s_od, res.to(out_ptr.dtype.element_ty),
                 mask=tile_mask)
        tl.store(lse_ptr + r * s_lo, lse, mask=r_mask & (offs_r * 0 + cb == 0))  # once per row


def merge_splits_triton(
    part_out: torch.Tensor,  # [S, T, H, Dv] fp32
    part_lse: torch.Tensor,  # [S, T, H] fp32
    out: torch.Tensor,  # [T, H, Dv] written (any float dtype)
    lse: torch.Tensor,  # [T, H] fp32 written
    *,
    num_programs: int | None = None,
) -> None:
    """Merge the S splits' partials into out / lse in place (see the module docstring).

    part_out / part_lse must be contiguous over (T, H) (the launchers allocate them);
    out and lse contiguous over (T, H). CUDA: one program per item (the hardware
    schedules the waves); NPU / CPU: a persistent grid of one program per core."""
    S, T, H, Dv = part_out.shape
    n_rows = T * H
    if n_rows == 0:
        return
    if part_lse.shape != (S, T, H) or out.shape != (T, H, Dv) or lse.shape != (T, H):
        raise ValueError(f"partials {tuple(part_out.shape)} / {tuple(part_lse.shape)} do not fit out "
                         f"{tuple(out.shape)}, lse {tuple(lse.shape)}")
    for name, x in (("part_out", part_out[0]), ("part_lse", part_lse[0]), ("out", out), ("lse", lse)):
        if x.dim() >= 2 and x.stride(0) != H * x.stride(1):
            raise ValueError(f"{name} strides {tuple(x.stride())}: (T, H) must flatten to rows")
    device = out.device
    target, cores = target_of(device)
    block_d = min(next_pow2(Dv), MERGE_BLOCK_D)
    n_dblk = triton.cdiv(Dv, block_d)
    block_r = min(MERGE_BLOCK_R, next_pow2(n_rows))
    while block_r > 1 and triton.cdiv(n_rows, block_r) * n_dblk < cores:
        block_r //= 2  # smaller row blocks until every core has an item
    n_blocks = triton.cdiv(n_rows, block_r) * n_dblk
    if num_programs is None:
        num_programs = n_blocks if target == "cuda" else cores
    kernel_for(_sparse_split_merge_kernel, device)[(grid_size(n_blocks, device, num_programs),)](
        part_out, part_lse, out, lse,
        S, n_rows, Dv, n_dblk,
        part_out.stride(0), part_out.stride(2), part_out.stride(3),
        part_lse.stride(0), part_lse.stride(2),
        out.stride(1), out.stride(2),
        lse.stride(1),
        BLOCK_R=block_r, BLOCK_D=block_d,
    )


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    # The merge the sparse MLA launcher runs after a split launch (512 latent columns, 16 /
    # 128 heads, bf16 out), and an fp32 out at a Dv that is not a multiple of 64.
    for heads, dv, dtype in ((16, 512, torch.bfloat16), (128, 512, torch.bfloat16), (4, 40, torch.float32)):
        yield (f"{heads} heads Dv {dv} {str(dtype)[6:]}",
               functools.partial(merge_splits_triton, torch.empty(3, 2, heads, dv), torch.empty(3, 2, heads),
                                 torch.empty(2, heads, dv, dtype=dtype), torch.empty(2, heads)))


LOWERING = LoweringDeclaration(examples=_lowering_examples)
