"""Quantised KV pages (issue 39, decision 65): fp8_e4m3 / int8 rows with a dynamic fp32 scale.

A quantised paged cache is a pair: the pages `[NB, BS, ...row dims, D]` in int8 or
float8_e4m3fn, and a scale cache holding one fp32 scale per row, `[NB, BS, Hkv]` for a
GQA cache `[NB, BS, Hkv, D]` and `[NB, BS, 1]` for the MLA latent `[NB, BS, L+R]` (the
latent and its rope part share the token's scale). A row's scale is computed when the
token is written, `amax(|row|) / qmax` (dynamic, per token and KV head), and the stored
value is `row / scale` rounded to the page dtype; a reader dequantises `q * scale` in fp32
before the dot products. The scale sits at the same (page, offset) as its row, so under
DCP / PCP the sharded layout (docs/architecture.md §5) places it on the token's owner rank
with no layout code of its own.

Torch reference of every quantised read and write (the CPU path and the tests' oracle);
the Triton cache write and decode kernel implement the same arithmetic.
"""

from __future__ import annotations

import torch

# Largest finite magnitude of each page dtype: the scale maps a row's amax onto it.
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def scale_view(cache: torch.Tensor, scale_cache: torch.Tensor) -> torch.Tensor:
    """The scale cache as `cache.shape[:-1]` (one scale per row), a view: writes land in it.
    Refuses a scale cache that does not hold exactly one fp32 scale per (page, offset, head)."""
    rows = cache.shape[:-1]
    if scale_cache.dtype != torch.float32 or scale_cache.numel() != rows.numel() or \
            tuple(scale_cache.shape[:2]) != tuple(rows[:2]):
        raise ValueError(f"scale cache {tuple(scale_cache.shape)} {scale_cache.dtype} does not fit the quantised cache "
                         f"{tuple(cache.shape)} {cache.dtype}: it needs one fp32 scale per page, offset and KV head "
                         f"[{rows[0]}, {rows[1]}, {rows[2:].numel()}]; allocate both with allocate_kv_cache")
    return scale_cache.view(rows)


def check_pair(cache: torch.Tensor, scale_cache: torch.Tensor | None, what: str) -> None:
    """A quantised cache needs its scales, and a cache in the model's dtype takes none."""
    if is_quantized(cache.dtype) and scale_cache is None:
        raise ValueError(f"{what} is {cache.dtype} (a quantised KV cache) but no scale cache was passed; pass the "
                         "layer's scale cache (allocate_kv_cache with CPConfig(kv_cache_dtype=...) makes it)")
    if scale_cache is not None:
        if not is_quantized(cache.dtype):
            raise ValueError(f"{what} is {cache.dtype} but a scale cache was passed: scales are for int8 / "
                             "float8_e4m3fn caches only; drop the scale cache or allocate a quantised cache")
        scale_view(cache, scale_cache)


def quantize(x: torch.Tensor, dtype: torch.dtype,
             static_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (q [..., D] `dtype`, scale [...] fp32), one scale per row.
    An all-zero row gets scale 1 (its codes are 0 either way). `static_scale` (one fp32
    scalar, a checkpoint's per-layer k_scale / v_scale, decision 71) replaces the row's
    dynamic amax scale: every row gets it, and codes past the dtype's range are clamped."""
    xf = x.float()
    if static_scale is None:
        amax = xf.abs().amax(dim=-1)  # [...]
        scale = torch.where(amax > 0, amax / QMAX[dtype], torch.ones_like(amax))
    else:
        scale = static_scale.float().reshape(()).expand(xf.shape[:-1]).contiguous()  # [...] the layer's one scale
    y = xf / scale[..., None]
    if dtype == torch.int8:
        q = torch.round(y).clamp(-127, 127).to(torch.int8)
    else:
        q = y.clamp(-QMAX[dtype], QMAX[dtype]).to(dtype)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [..., D] int8 / fp8, scale [...] -> fp32 [..., D]."""
    return q.float() * scale[..., None].float()


def bytes_view(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as uint8 (CPU index_copy_ / index_select have no fp8 kernels); others as is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def write_quantized(cache: torch.Tensor, scale_cache: torch.Tensor, new: torch.Tensor,
                    slot_mapping: torch.Tensor, static_scale: torch.Tensor | None = None) -> None:
    """cache[slot], scale[slot] = quantize(new[t]) for every token with slot >= 0 (in place).
    new [T', ...row dims, D] (T' >= T), cache [NB, BS, ...row dims, D], scale_cache one per row.
    With `static_scale` every row is stored with that scale (its readers are unchanged)."""
    scales = scale_view(cache, scale_cache)
    flat = bytes_view(cache).view(-1, *cache.shape[2:])  # [NB * BS, ..., D]
    sflat = scales.view(-1, *scales.shape[2:])  # [NB * BS, ...]
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].long()
    q, s = quantize(new[: slot_mapping.shape[0]][keep].reshape(-1, *cache.shape[2:]), cache.dtype, static_scale)
    flat.index_copy_(0, idx, bytes_view(q))
    sflat.index_copy_(0, idx, s)


def check_static_scale(static_scale: torch.Tensor | None, what: str) -> None:
    """A static scale is one finite, positive fp32 value (a checkpoint's per-layer k_scale / v_scale)."""
    if static_scale is None:
        return
    if static_scale.numel() != 1 or static_scale.dtype != torch.float32:
        raise ValueError(f"{what} {tuple(static_scale.shape)} {static_scale.dtype} is not one fp32 scale; pass the "
                         "layer's per-tensor scale as a one-element fp32 tensor (cp_compile.serving.hf.kv_scales)")



def refuse_static_scale(op: str, *static_scales: object) -> None:
    """The NPU paths (torch_npu kernels, GE converters) write dynamic scales only: a checkpoint's
    static scale (decision 71) is served with kv_cache_dtype fp8_e4m3, which FusedInferAttentionScore
    cannot read, so a static scale there is refused by name rather than silently replaced."""
    if any(s is not None for s in static_scales):
        raise NotImplementedError(
            f"{op}: the NPU kernels and GE converters write dynamic per-token scales only; a static per-layer "
            "scale (a checkpoint's k_scale / v_scale, decision 71) is not mapped there (it is used with "
            "kv_cache_dtype='fp8_e4m3', which FusedInferAttentionScore does not read). Fix: on the NPU use "
            "kv_cache_dtype='int8' (dynamic scales), or serve the static scales on CPU / CUDA")
