"""Global slot mapping -> this DCP rank's physical slots (docs/architecture.md §5).

A global slot is `block_id * (Bk * N) + offset` in a virtual block of Bk*N tokens;
virtual blocks start at multiples of Bk*N, so `offset` is the request-local position
modulo Bk*N and the owner / local offset follow from it alone. Non-owned and
padding (-1) slots map to -1. Torch oracle: `cp_compile.ops.core.layout.local_slot_mapping`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.paged import launch as paged_launch
from cp_compile.ops.core.triton_common import LoweringDeclaration, grid_size, kernel_for, next_pow2

_MAX_BLOCK = 1024  # tokens per tile


@triton.jit
def _local_slot_mapping_kernel(
    slot_ptr, res_ptr, T,
    block_size, cp, rank, interleave,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    vbs = block_size * cp  # tokens of one virtual block
    n_blocks = (T + BLOCK - 1) // BLOCK
    for b in range(pid, n_blocks, nprog):
        i = b * BLOCK + offs
        i_mask = i < T
        slot = tl.load(slot_ptr + i, mask=i_mask, other=-1).to(tl.int64)
        valid = slot >= 0
        # Clamp so the division never sees a negative slot (Triton divides toward zero,
        # torch floors); invalid lanes are overwritten with -1 below anyway.
        slot = tl.where(valid, slot, 0)
        vb = slot // vbs  # virtual block id: int64, the slot range may pass 2**31
        off = (slot - vb * vbs).to(tl.int32)  # < Bk*N: int32 is enough from here on
        owner = (off // interleave) % cp
        local_off = (off // (cp * interleave)) * interleave + off % interleave
        local = vb * block_size + local_off.to(tl.int64)
        keep = valid & (owner == rank)
        tl.store(res_ptr + i, tl.where(keep, local, -1).to(res_ptr.dtype.element_ty), mask=i_mask)


def local_slot_mapping_triton(
    slot_mapping: torch.Tensor,  # [T] int64 (or int32) global slots, -1 = skip
    *,
    cp: int,
    rank: int,
    interleave: int,
    block_size: int,
    num_programs: int | None = None,
    block: int | None = None,
) -> torch.Tensor:
    """Triton twin of `layout.local_slot_mapping` -> [T] local slots, -1 elsewhere.

    Output dtype is slot_mapping's (int64 for the usual vLLM slot mapping), as in the
    reference. block_size is the per-rank page size Bk; a virtual block is Bk * cp.
    """
    if slot_mapping.dim() != 1:
        raise ValueError(f"slot_mapping must be 1-D, got shape {tuple(slot_mapping.shape)}")
    if not (0 <= rank < cp) or interleave < 1 or block_size < 1:
        raise ValueError(f"bad layout: block_size={block_size} cp={cp} rank={rank} interleave={interleave}")
    slot_mapping = slot_mapping.contiguous()
    T = slot_mapping.shape[0]
    res = torch.empty_like(slot_mapping)
    if T == 0:
        return res
    if block is None:
        block = min(next_pow2(T), _MAX_BLOCK)
    grid = (grid_size(triton.cdiv(T, block), slot_mapping.device, num_programs),)
    kernel_for(_local_slot_mapping_kernel, slot_mapping.device)[grid](
        slot_mapping, res, T, int(block_size), int(cp), int(rank), int(interleave), BLOCK=block,
    )
    return res


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    # The registered kernels (launch.py) are what device runs launch.
    # BLOCK = next_pow2(T) up to _MAX_BLOCK: every power of two a batch can produce.
    for i in range(_MAX_BLOCK.bit_length()):
        T = 1 << i
        slots = torch.zeros(T, dtype=torch.int64)
        qsl = torch.tensor([0, T], dtype=torch.int32)
        seq_lens = torch.tensor([T], dtype=torch.int32)
        yield f"{T} tokens", functools.partial(paged_launch.dcp_localize_metadata, slots, qsl, seq_lens, 2, 0, 1, 128)


LOWERING = LoweringDeclaration(
    examples=_lowering_examples,
    int64={"_local_slot_mapping_kernel": (
        "slot values are int64 data (the slot mapping's dtype, global slots may pass 2**31); "
        "one division per token, no int64 addressing")},
)
