"""DCP decode merge of partial attentions by their LSEs (docs/architecture.md §5).

Two kernels, one per communication strategy:
- `merge_partials_triton`: all-to-all of [out | lse], then every rank combines the N
  partials of its own heads: out = sum_n out_n * exp(lse_n - LSE).
- `lse_rescale_triton`: all-gather of the LSEs only, each rank scales its own partial
  by exp(lse_r - LSE) and a reduce-scatter sums them.
Empty shards (lse -inf) weigh 0 and an all-empty row is 0, never NaN; a NaN or +inf
LSE is invalid and makes its row NaN (strict, decision 47: not read as empty). The max
is taken before any sum, so the result does not depend on shard order beyond fp32
rounding. Torch oracle: `cp_compile.ops.merge.reference.merge_partials`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.attention_tile import lse_logsumexp, lse_merge_rows
from cp_compile.ops.merge import launch as merge_launch
from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    prev_pow2,
    require_int32_offsets,
)

# Rows x padded head dim held by one tile.
_TILE_BUDGET = 4096
_MAX_BLOCK_R = 64


@triton.jit
def _merge_partials_kernel(
    outs_ptr, lses_ptr, res_ptr, lse_out_ptr,
    N, n_rows, H, Dv,
    s_on, s_ot, s_oh, s_od,
    s_ln, s_lt, s_lh,
    s_rt, s_rh, s_rd,
    s_mt, s_mh,
    BLOCK_R: tl.constexpr, DV_PAD: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, DV_PAD)
    d_mask = offs_d < Dv
    n_blocks = (n_rows + BLOCK_R - 1) // BLOCK_R
    for rb in range(pid, n_blocks, nprog):
        r = rb * BLOCK_R + offs_r  # flattened (token, head) rows
        r_mask = r < n_rows
        t = r // H  # int32: the launcher checked every tensor's span fits
        h = r % H
        l_row = t * s_lt + h * s_lh
        o_row = t * s_ot + h * s_oh
        tile_mask = r_mask[:, None] & d_mask[None, :]

        # The shared LSE merge (core/attention_tile.py), the shard offsets advanced by the
        # shard stride.
        res, lse_tot = lse_merge_rows(outs_ptr, lses_ptr, o_row, l_row, offs_d * s_od, s_on, s_ln, N, r_mask,
                                      tile_mask, BLOCK_R, DV_PAD)
        tl.store(res_ptr + t[:, None] * s_rt + h[:, None] * s_rh + offs_d[None, :] * s_rd, res, mask=tile_mask)
        if WRITE_LSE:  # merged LSE, -inf for all-empty rows (feeds a later merge)
            tl.store(lse_out_ptr + t * s_mt + h * s_mh, lse_tot, mask=r_mask)


@triton.jit
def _lse_rescale_kernel(
    out_ptr, lse_ptr, lse_all_ptr, res_ptr, lse_out_ptr,
    N, n_rows, H, Dv,
    s_ot, s_oh, s_od,
    s_lt, s_lh,
    s_an, s_at, s_ah,
    s_rt, s_rh, s_rd,
    s_mt, s_mh,
    BLOCK_R: tl.constexpr, DV_PAD: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, DV_PAD)
    d_mask = offs_d < Dv
    n_blocks = (n_rows + BLOCK_R - 1) // BLOCK_R
    for rb in range(pid, n_blocks, nprog):
        r = rb * BLOCK_R + offs_r
        r_mask = r < n_rows
        t = r // H
        h = r % H
        a_row = t * s_at + h * s_ah
        tile_mask = r_mask[:, None] & d_mask[None, :]

        # The merged LSE over the shards (core/attention_tile.py, the preamble shared with
        # the combine): NaN / +inf LSEs make the row NaN, all-empty rows -inf.
        lse_tot = lse_logsumexp(lse_all_ptr, a_row, s_an, N, r_mask, BLOCK_R)

        own = tl.load(lse_ptr + t * s_lt + h * s_lh, mask=r_mask, other=float("-inf")).to(tl.float32)
        # Own shard empty (so is an all-empty row): weight 0, out not read; a NaN own or
        # total LSE gives NaN (exp of NaN), as the reference.
        empty = own == float("-inf")
        w = tl.where(empty, 0.0, tl.exp(own - lse_tot))
        o = tl.load(out_ptr + t[:, None] * s_ot + h[:, None] * s_oh + offs_d[None, :] * s_od,
                    mask=tile_mask, other=0.0).to(tl.float32)
        res = tl.where(empty[:, None], 0.0, o * w[:, None])
        tl.store(res_ptr + t[:, None] * s_rt + h[:, None] * s_rh + offs_d[None, :] * s_rd, res, mask=tile_mask)
        if WRITE_LSE:
            tl.store(lse_out_ptr + t * s_mt + h * s_mh, lse_tot, mask=r_mask)


def _row_block(dv_pad: int, n_rows: int, block_r: int | None) -> int:
    if block_r is None:
        block_r = min(prev_pow2(max(_TILE_BUDGET // dv_pad, 1)), next_pow2(n_rows), _MAX_BLOCK_R)
    if block_r & (block_r - 1):
        raise ValueError(f"block_r={block_r} must be a power of two")
    return block_r


def _check_lse_out(lse_out: torch.Tensor | None, T: int, H: int) -> bool:
    if lse_out is None:
        return False
    if tuple(lse_out.shape) != (T, H) or lse_out.dtype != torch.float32:
        raise ValueError(f"lse_out must be fp32 [{T}, {H}], got {lse_out.dtype} {tuple(lse_out.shape)}")
    return True


def _launch_rows(kernel, inputs: tuple[torch.Tensor, ...], N: int, T: int, H: int, Dv: int,
                 device: torch.device, lse_out: torch.Tensor | None, num_programs: int | None,
                 block_r: int | None) -> torch.Tensor:
    """Shared launch of the two row kernels: fp32 result [T, H, Dv], empty cases
    handled on the host, then `kernel(*inputs, res, lse_out, N, rows, H, Dv,
    *strides of inputs, res and lse_out, ...)` over a persistent grid of row blocks."""
    res = torch.empty(T, H, Dv, dtype=torch.float32, device=device)
    n_rows = T * H
    if n_rows == 0:
        return res
    write_lse = _check_lse_out(lse_out, T, H)
    if N == 0:  # no shard at all: every row is empty
        if write_lse:
            lse_out.fill_(float("-inf"))
        return res.zero_()
    require_int32_offsets(**{f"input {i}": t for i, t in enumerate(inputs)}, result=res,
                          **({"lse_out": lse_out} if write_lse else {}))
    dv_pad = next_pow2(Dv)
    block_r = _row_block(dv_pad, n_rows, block_r)
    grid = (grid_size(triton.cdiv(n_rows, block_r), device, num_programs),)
    strides = [st for t in inputs for st in t.stride()]
    kernel_for(kernel, device)[grid](
        *inputs, res, lse_out if write_lse else res,
        N, n_rows, H, Dv,
        *strides, *res.stride(),
        *(lse_out.stride() if write_lse else (0, 0)),
        BLOCK_R=block_r, DV_PAD=dv_pad, WRITE_LSE=write_lse,
    )
    return res


def merge_partials_triton(
    outs: torch.Tensor,  # [N, T, H, Dv] partial outputs, any float dtype / strides
    lses: torch.Tensor,  # [N, T, H] their LSEs (natural log)
    *,
    lse_out: torch.Tensor | None = None,
    num_programs: int | None = None,
    block_r: int | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.merge_partials` -> out [T, H, Dv] fp32.

    LSE = logsumexp_n(lse_n); out = sum_n out_n * exp(lse_n - LSE). A partial with
    lse -inf weighs 0 (its out is not read into the sum, even if NaN); a row
    whose partials are all empty is 0; a NaN / +inf LSE makes the row NaN. If `lse_out` ([T, H] fp32, any strides) is
    given, the merged LSE is written there (-inf for all-empty rows).
    """
    N, T, H, Dv = outs.shape
    if tuple(lses.shape) != (N, T, H):
        raise ValueError(f"lses {tuple(lses.shape)} does not fit outs {tuple(outs.shape)}")
    return _launch_rows(_merge_partials_kernel, (outs, lses), N, T, H, Dv, outs.device, lse_out, num_programs,
                        block_r)


def lse_rescale_triton(
    out: torch.Tensor,  # [T, H, Dv] this shard's partial output
    lse: torch.Tensor,  # [T, H] this shard's LSE
    lse_all: torch.Tensor,  # [N, T, H] every shard's LSE (all-gathered)
    *,
    lse_out: torch.Tensor | None = None,
    num_programs: int | None = None,
    block_r: int | None = None,
) -> torch.Tensor:
    """out * exp(lse - logsumexp_n(lse_all)) in fp32 -> [T, H, Dv].

    Summing the results over the N shards (reduce-scatter) equals
    `merge_partials(outs, lse_all)`. A row whose own lse is -inf, or whose
    shards are all empty, gets 0; a NaN / +inf LSE (own or another shard's) gives NaN. lse_all may be a strided view, e.g. a head-major
    all-gather buffer [N*H, T] passed as `.view(N, H, T).permute(0, 2, 1)`.
    If `lse_out` ([T, H] fp32) is given, logsumexp_n(lse_all) is written there
    (-inf for all-empty rows).
    """
    T, H, Dv = out.shape
    N = lse_all.shape[0]
    if tuple(lse.shape) != (T, H) or tuple(lse_all.shape[1:]) != (T, H):
        raise ValueError(f"lse {tuple(lse.shape)} / lse_all {tuple(lse_all.shape)} do not fit out {tuple(out.shape)}")
    return _launch_rows(_lse_rescale_kernel, (out, lse, lse_all), N, T, H, Dv, out.device, lse_out, num_programs,
                        block_r)


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    # The registered kernels (launch.py) are what device runs launch.
    # The row count picks BLOCK_R (_row_block): every power of two until it stops
    # growing; Dv 128 (GQA) and 512 (MLA latent); partials in bf16 and fp32.
    for dv in (128, 512):
        rows = [1]
        while _row_block(next_pow2(dv), 2 * rows[-1], None) == 2 * rows[-1]:
            rows.append(2 * rows[-1])
        cap = rows[-1]
        for dtype in (torch.bfloat16, torch.float32):
            for n_rows in rows if dtype == torch.bfloat16 else [cap]:
                name = f"Dv {dv} {str(dtype)[6:]} {n_rows} rows"
                outs = torch.empty(2, n_rows, 1, dv, dtype=dtype)
                lses = torch.empty(2, n_rows, 1)
                yield f"lse_combine {name}", functools.partial(merge_launch.lse_combine, outs, lses)
                yield (f"lse_rescale {name}",
                       functools.partial(merge_launch.lse_rescale, outs[0], lses[0], lses.permute(0, 2, 1).reshape(-1, n_rows)))
        # Without lse_out (WRITE_LSE=False): the launchers' default.
        outs, lses = torch.empty(2, cap, 1, dv), torch.empty(2, cap, 1)
        yield f"merge_partials Dv {dv} no lse_out", functools.partial(merge_partials_triton, outs, lses)
        yield f"lse_rescale Dv {dv} no lse_out", functools.partial(lse_rescale_triton, outs[0], lses[0], lses)


LOWERING = LoweringDeclaration(examples=_lowering_examples)
