"""Paged cache write: cache[slot] = new[t] for every token with slot >= 0.

One work item is (token, column block of the flattened row); a slot of -1
(padding, or a token another DCP rank stores) writes nothing. No boolean-mask
indexing (the reference's `slot_mapping[keep]` has a data-dependent size, i.e. a
host sync), so it captures in a CUDA graph / aclgraph. Torch oracle:
`cp_compile.ops.core.paged_cache.write_cache`.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core.triton_common import (
    LoweringDeclaration,
    grid_size,
    kernel_for,
    next_pow2,
    require_int32_offsets,
)

_MAX_BLOCK = 1024  # row elements per tile


@triton.jit
def _cache_write_kernel(
    new_ptr, cache_ptr, slot_ptr,
    T, row, n_cblk, block_size,
    s_nt, s_cb, s_cs,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    for w in range(pid, T * n_cblk, nprog):
        t = w // n_cblk
        c = (w % n_cblk) * BLOCK + offs  # columns of the flattened row
        slot = tl.load(slot_ptr + t)
        keep = slot >= 0
        # < num_blocks * block_size, which the launcher checked fits int32.
        s32 = tl.where(keep, slot, 0).to(tl.int32)
        page = s32 // block_size
        m = c < tl.where(keep, row, 0)  # a skipped token masks every column
        x = tl.load(new_ptr + t * s_nt + c, mask=m, other=0.0)
        tl.store(cache_ptr + page * s_cb + (s32 % block_size) * s_cs + c, x, mask=m)


def cache_write_triton(new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                       num_programs: int | None = None, block: int | None = None) -> None:
    """Triton twin of `reference.write_cache` (in place): new [T', ...] (T' >= T rows,
    any dtype), cache [NB, BS, ...] with contiguous inner dims, slot_mapping [T]."""
    T = slot_mapping.shape[0]
    if T == 0:
        return
    NB, BS = cache.shape[0], cache.shape[1]
    row = 1
    for d in cache.shape[2:]:
        row *= d
    inner = cache[0, 0] if cache.dim() > 2 else cache[0, 0:1]
    if cache.stride(1) < row or not inner.is_contiguous():
        raise ValueError(f"cache {tuple(cache.shape)} strides {cache.stride()}: the cache write needs each slot's "
                         "row contiguous (allocate caches with torch.zeros / kv_cache.allocate_kv_cache)")
    # Cast with torch (round to nearest even, as the reference's .to(cache.dtype)), so
    # the kernel is a plain copy: the interpreter's fp32 -> bf16 cast truncates.
    new = new[:T].reshape(T, row).to(cache.dtype)
    if new.stride(1) != 1:
        new = new.contiguous()
    require_int32_offsets(new=new, cache=cache)
    block = block or min(next_pow2(row), _MAX_BLOCK)
    n_cblk = triton.cdiv(row, block)
    grid = (grid_size(T * n_cblk, cache.device, num_programs),)
    kernel_for(_cache_write_kernel, cache.device)[grid](
        new, cache, slot_mapping.contiguous(), T, row, n_cblk, BS, new.stride(0), cache.stride(0), cache.stride(1),
        BLOCK=block,
    )


def cache_write_device(new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """`cp::cache_write` on an accelerator."""
    cache_write_triton(new, cache, slot_mapping)


# ----------------------------------------------------------------------------- lowering check


def _lowering_examples():
    slots = torch.zeros(2, dtype=torch.int64)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        # GQA K/V [NB, BS, Hkv, D], the MLA latent [NB, BS, 576], the indexer keys [NB, BS, 128].
        for shape in ((1, 128), (8, 128), (576,), (128,)) if dtype == torch.bfloat16 else ((8, 128),):
            cache = torch.empty(2, 16, *shape, dtype=dtype)
            yield (f"{str(dtype)[6:]} row {shape}",
                   functools.partial(cache_write_device, torch.empty(2, *shape, dtype=dtype), cache, slots))
    cache = torch.empty(2, 16, 576, dtype=torch.bfloat16)  # fp32 new rows into a bf16 cache
    yield "fp32 -> bf16 row 576", functools.partial(cache_write_device, torch.empty(2, 576), cache, slots)


LOWERING = LoweringDeclaration(
    examples=_lowering_examples,
    int64={"_cache_write_kernel": "slot values are int64 data (vLLM's slot mapping dtype); cast to int32 once "
                                  "after the -1 test, no int64 addressing"},
)
