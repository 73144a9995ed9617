"""Torch reference of `cp::mla_preprocess` (MLAPO): the MLA block before attention.

Written step for step in the order the example models and Hugging Face DeepSeek
compute it (RMSNorm in fp32 then `weight * x.to(dtype)`, rope with cos / sin cast to
the activation dtype, the absorption as the same einsum), so the fused op gives the
unfused graph's values: bit for bit where the unfused graph runs the same kernels
(the reference on CPU), to rounding elsewhere.

Rope layouts (`rope_mode`), R = rope dims, pairs rotated by frequency i:

| mode | pairs | output layout | who |
|---|---|---|---|
| `interleave` | (2i, 2i+1) | interleaved (as input) | example models (DeepSeek's own code, V2) |
| `interleave_split` | (2i, 2i+1) | [rotated evens, rotated odds] | HF DeepSeek-V3 `apply_rotary_pos_emb_interleave` |
| `neox` | (i, i + R/2) | halves | example / HF with `rope_interleave=False` |
| `interleave_fp32` | (2i, 2i+1) | interleaved, rotated in fp32 then cast | HF DeepSeek-V2 (complex `freqs_cis`) in bf16 / fp16 |

Both q_pe and k_pe use the same layout, so q . k is the same in all three; the
latent cache stores k_pe in the model's layout, which is why the mode is explicit.

Linears: a float weight is [out, in] (`F.linear`); an int8 weight is the K-major
[in, out] of `cp::w8a8_dynamic_linear` with its per-output-channel scale and offset
(per-token activation quantisation, one group), computed by the same reference
function the unfused W8A8 graph runs (`quant_reference.w8a8_dynamic_linear`).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from cp_compile.ops.quant import reference as quant_reference
from cp_compile.ops.core import paged_cache

ROPE_MODES = ("interleave", "interleave_split", "neox", "interleave_fp32")


def linear(x: Tensor, weight: Tensor, scale: Tensor | None, offset: Tensor | None,
           w8a8: Callable[..., Tensor] = quant_reference.w8a8_dynamic_linear) -> Tensor:
    """x [T, in] -> [T, out]: float `F.linear` (weight [out, in]) or W8A8 dynamic (int8 weight [in, out])
    through `w8a8` (the reference; a device's W8A8 kernel on an accelerator)."""
    if weight.dtype == torch.int8:
        if scale is None or offset is None:
            raise ValueError("mla_preprocess: an int8 weight needs its weight scale and offset "
                             "(W8A8 dynamic: per-output-channel scale fp32 [out], offset int32 [out])")
        return w8a8(x, weight, scale, offset, 1)
    return F.linear(x, weight)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """HF / example RMSNorm: fp32 statistics, `weight * normed.to(x.dtype)`."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rope(x: Tensor, cos: Tensor, sin: Tensor, mode: str) -> Tensor:
    """x [T, H, R], cos / sin [T, R/2] (fp32) -> rotated [T, H, R] in x's dtype, layout per `mode`."""
    if mode == "interleave_fp32":  # HF DeepSeek-V2: x.float() times the fp32 table, then back to x's dtype
        return rope(x.float(), cos, sin, "interleave").to(x.dtype)
    c = cos[:, None, :].to(x.dtype)  # [T, 1, R/2]
    s = sin[:, None, :].to(x.dtype)
    if mode == "neox":
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]  # [T, H, R/2]
    if mode == "interleave":
        return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    if mode == "interleave_split":
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    raise ValueError(f"mla_preprocess: rope_mode={mode!r}; use one of {ROPE_MODES}")


def mla_preprocess(x: Tensor, q_a_weight: Tensor | None, q_a_scale: Tensor | None, q_a_offset: Tensor | None,
                   q_a_norm: Tensor | None, q_b_weight: Tensor, q_b_scale: Tensor | None,
                   q_b_offset: Tensor | None, kv_a_weight: Tensor, kv_a_scale: Tensor | None,
                   kv_a_offset: Tensor | None, kv_norm: Tensor, w_uk: Tensor, cos: Tensor, sin: Tensor,
                   kv_cache: Tensor | None, slot_mapping: Tensor | None, q_eps: float, kv_eps: float,
                   rope_mode: str, w8a8: Callable[..., Tensor] = quant_reference.w8a8_dynamic_linear,
                   write: Callable[[Tensor, Tensor, Tensor], None] | None = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (q_abs [T, H, L], q_pe [T, H, R], kv_c [T, L], k_pe [T, R], q_resid [T, q_lora] or [T, 0]).

    x [T, D]; w_uk [H, nope, L] (this rank's heads); with `kv_cache` [NB, BS, L+R]
    the latent [kv_c | k_pe] is written at `slot_mapping` (-1 skips). `w8a8` / `write`:
    the W8A8 linear and the cache write to use (defaults: the references).
    """
    lin = lambda a, w, s, o: linear(a, w, s, o, w8a8)  # noqa: E731
    T = x.shape[0]
    H, nope, L = w_uk.shape
    if q_a_weight is not None:
        q_resid = rms_norm(lin(x, q_a_weight, q_a_scale, q_a_offset), q_a_norm, q_eps)  # [T, q_lora]
        q = lin(q_resid, q_b_weight, q_b_scale, q_b_offset)
    else:
        q_resid = x.new_zeros(T, 0)
        q = lin(x, q_b_weight, q_b_scale, q_b_offset)
    q = q.view(T, H, -1)  # [T, H, nope + R]
    R = q.shape[-1] - nope
    q_nope, q_pe = torch.split(q, [nope, R], dim=-1)
    kv_c, k_pe = torch.split(lin(x, kv_a_weight, kv_a_scale, kv_a_offset), [L, R], dim=-1)  # [T, L], [T, R]
    kv_c = rms_norm(kv_c, kv_norm, kv_eps)
    q_pe = rope(q_pe, cos, sin, rope_mode)  # [T, H, R]
    k_pe = rope(k_pe[:, None, :], cos, sin, rope_mode)[:, 0]  # [T, R]
    q_abs = torch.einsum("thn,hnl->thl", q_nope, w_uk)  # [T, H, L]
    if kv_cache is not None:
        (write or paged_cache.write_cache)(kv_cache, torch.cat([kv_c, k_pe], dim=-1), slot_mapping)
    return q_abs.contiguous(), q_pe.contiguous(), kv_c.contiguous(), k_pe.contiguous(), q_resid
