"""Paged cache write: cache[slot] = new[t] for every token with slot >= 0.

One work item is (token, column block of the flattened row); a slot of -1
(padding, or a token another DCP rank stores) writes nothing. No boolean-mask
indexing (the reference's `slot_mapping[keep]` has a data-dependent size, i.e. a
host sync), so it captures in a CUDA graph / aclgraph. Torch oracle:
`cp_compile.ops.core.paged_cache.write_cache`.

A quantised cache (int8 / fp8, issue 39) is written by `_cache_write_quant_kernel`: one
work item is (token, row) (a GQA KV head's D columns, or the MLA latent's L+R), whose
amax gives the row's fp32 scale (stored beside the page) and whose codes are
`row / scale` rounded as the torch oracle `ops/core/kv_quant.quantize` rounds them
(division rounded to nearest, int8 half to even, fp8 clamped to +-448 then cast).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cp_compile.ops.core import kv_quant
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


@triton.jit
def _rint(y):
    """Round to the nearest integer, half to even (torch.round), in fp32."""
    f = tl.floor(y)
    d = y - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0
    return tl.where(d > 0.5, f + 1.0, tl.where(d < 0.5, f, tl.where(odd, f + 1.0, f)))


@triton.jit
def _round_e4m3(y):
    """y (|y| <= 448) rounded to the float8_e4m3fn grid, half to even, still fp32: the cast that
    follows is then exact on every backend (the interpreter's fp8 cast does not round to nearest).
    The grid step is 2^(e - 3) for a normal exponent e >= -6, 2^-9 below (subnormals)."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    return _rint(y / step) * step  # exact: step is a power of two


@triton.jit
def _cache_write_quant_kernel(
    new_ptr, cache_ptr, scale_ptr, slot_ptr,
    T, R, D, block_size, qmax,
    s_nt, s_nr, s_cb, s_cs, s_cr, s_sb, s_ss, s_sr,
    BLOCK: tl.constexpr, INT8: tl.constexpr,
):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    for w in range(pid, T * R, nprog):
        t = w // R
        r = w % R  # the row: a KV head (GQA) or the whole latent (MLA, R = 1)
        slot = tl.load(slot_ptr + t)
        keep = slot >= 0
        s32 = tl.where(keep, slot, 0).to(tl.int32)
        page = s32 // block_size
        off = s32 % block_size
        m = offs < tl.where(keep, D, 0)
        x = tl.load(new_ptr + t * s_nt + r * s_nr + offs, mask=m, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, qmax), 1.0)
        y = tl.math.div_rn(x, scale)
        y = tl.minimum(tl.maximum(y, -qmax), qmax)
        if INT8:
            y = _rint(y)
        else:
            y = _round_e4m3(y)
        tl.store(cache_ptr + page * s_cb + off * s_cs + r * s_cr + offs, y.to(cache_ptr.dtype.element_ty), mask=m)
        tl.store(scale_ptr + page * s_sb + off * s_ss + r * s_sr, scale, mask=keep)


def cache_write_quant_triton(new: torch.Tensor, cache: torch.Tensor, scale_cache: torch.Tensor,
                             slot_mapping: torch.Tensor, *, num_programs: int | None = None) -> None:
    """Triton twin of `kv_quant.write_quantized` (in place): new [T', ...rows, D] (T' >= T),
    cache [NB, BS, ...rows, D] int8 / float8_e4m3fn, scale_cache fp32 one per row."""
    T = slot_mapping.shape[0]
    if T == 0:
        return
    scales = kv_quant.scale_view(cache, scale_cache)  # [NB, BS, ...rows]
    BS, D = cache.shape[1], cache.shape[-1]
    R = cache.shape[2:-1].numel()
    if cache.stride(-1) != 1 or (R > 1 and cache.stride(-2) != D) or (R > 1 and scales.stride(-1) != 1):
        raise ValueError(f"cache {tuple(cache.shape)} strides {cache.stride()}: the quantised cache write needs "
                         "contiguous rows (allocate caches with kv_cache.allocate_kv_cache)")
    new = new[:T].reshape(T, R, D)
    if new.stride(2) != 1:
        new = new.contiguous()
    require_int32_offsets(new=new, cache=cache, scale_cache=scale_cache)
    s_cr = cache.stride(-2) if R > 1 else 0
    s_sr = scales.stride(-1) if R > 1 else 0
    grid = (grid_size(T * R, cache.device, num_programs),)
    kernel_for(_cache_write_quant_kernel, cache.device)[grid](
        new, cache, scales, slot_mapping.contiguous(), T, R, D, BS, kv_quant.QMAX[cache.dtype],
        new.stride(0), new.stride(1), cache.stride(0), cache.stride(1), s_cr, scales.stride(0), scales.stride(1), s_sr,
        BLOCK=next_pow2(D), INT8=cache.dtype == torch.int8,
    )


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


def cache_write_device(new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
                       scale_cache: torch.Tensor | None = None) -> None:
    """`cp::cache_write` on an accelerator (quantised with `scale_cache`: issue 39)."""
    kv_quant.check_pair(cache, scale_cache, "the cache")
    if scale_cache is not None:
        cache_write_quant_triton(new, cache, scale_cache, slot_mapping)
    else:
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
    # Quantised caches (issue 39): GQA K/V heads of 128 and the MLA latent + rope (one scale per token).
    for qdtype in (torch.int8, torch.float8_e4m3fn):
        for shape, scale_shape in (((8, 128), (8,)), ((576,), (1,))):
            cache = torch.empty(2, 16, *shape, dtype=qdtype)
            yield (f"bf16 -> {str(qdtype)[6:]} row {shape}",
                   functools.partial(cache_write_device, torch.empty(2, *shape, dtype=torch.bfloat16), cache, slots,
                                     torch.empty(2, 16, *scale_shape)))


_QUANT_NOT_ON_NPU = ("the NPU declares the quantised-KV ops Absent (docs/quant_kv.md): triton-adapter-opt aborts "
                     "on the int8 write and triton-ascend has no fp8 type")

LOWERING = LoweringDeclaration(
    examples=_lowering_examples,
    int64={"_cache_write_kernel": "slot values are int64 data (vLLM's slot mapping dtype); cast to int32 once "
                                  "after the -1 test, no int64 addressing",
           "_cache_write_quant_kernel": "the same int64 slot mapping as _cache_write_kernel"},
    helpers=("_rint", "_round_e4m3"),
    not_on_ascend={"_cache_write_quant_kernel": _QUANT_NOT_ON_NPU},
)
