"""CPU kernel of `cp::mla_preprocess` (issue 27): the reference's arithmetic, without its copies.

The reference (`mla_preprocess_reference.mla_preprocess`) is written in the models'
order for readability: every step allocates, the absorption's einsum returns a
permuted `[T, H, L]` that `.contiguous()` copies again, the latent is concatenated
before the cache write and both ropes build their result with `stack` / `cat`. This
kernel computes the same values (bit for bit: the same elementwise operations in the
same order, the same library GEMMs) straight into the op's outputs:

    q, kv         = the library GEMMs (F.linear; W8A8: the reference int8 linear), as the reference
    kv_c          = rms_norm(kv[:, :L]) in one buffer (the weight multiplied in place)
    q_pe, k_pe    = rope written into their output buffers (the two halves of each pair by `out=`)
    q_abs         = bmm(q_nope as [H, T, nope], W_UK) with `out=` the [H, T, L] view of [T, H, L]
    cache[slots]  = kv_c and k_pe copied into the rows' two column ranges (no [T, L + R] concat)

At the DeepSeek-R1 per-rank shape the op is GEMM-bound on CPU (about 84 MB of fp32
weights per layer against a tail of a few MB), so this removes the tail's overhead,
not the GEMMs' time (docs/mla_preprocess.md "Speed on CPU"). The reference stays the
oracle (`tests/ops/test_mla_preprocess.py` compares the two bit for bit).
"""

from __future__ import annotations

import torch
from torch import Tensor

from cp_compile.ops.mla_preprocess import reference as ref


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`ref.rms_norm` (fp32 statistics, `weight * normed.to(x.dtype)`) with one output buffer."""
    xf = x.float()
    normed = torch.mul(xf, torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if weight.dtype != normed.dtype:  # promotes, as the reference's `weight * normed` does
        return weight * normed
    return torch.mul(weight, normed, out=normed)  # weight * normed, elementwise: the same products


def rope_into(out: Tensor, x: Tensor, cos: Tensor, sin: Tensor, mode: str) -> Tensor:
    """`ref.rope(x, cos, sin, mode)` written into `out` (x [T, h, R] may be a strided view)."""
    if mode == "interleave_fp32":  # rotated in fp32, cast once (not a CPU hot path: HF V2 in bf16)
        return out.copy_(ref.rope(x, cos, sin, mode))
    half = x.shape[-1] // 2
    c = cos[:, None, :].to(x.dtype)  # [T, 1, R/2]
    s = sin[:, None, :].to(x.dtype)
    if mode == "neox":
        x1, x2 = x[..., :half], x[..., half:]
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    if mode == "interleave":
        pairs = out.view(*out.shape[:-1], half, 2)
        o1, o2 = pairs[..., 0], pairs[..., 1]
    else:  # interleave_split, neox: the two halves
        o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c, out=o1).sub_(x2 * s)  # x1 c - x2 s
    torch.mul(x2, c, out=o2).add_(x1 * s)  # x2 c + x1 s
    return out


def write_latent(cache: Tensor, kv_c: Tensor, k_pe: Tensor, slot_mapping: Tensor) -> None:
    """cache[slot] = [kv_c | k_pe] for every token with slot >= 0 (`reference.write_cache`
    without building the concatenated latent)."""
    flat = cache.view(-1, cache.shape[-1])  # [NB * BS, L + R]
    L = kv_c.shape[-1]
    n = slot_mapping.shape[0]  # the reference writes new[:n] (as many tokens as slots)
    kv_c, k_pe = kv_c[:n], k_pe[:n]
    keep = slot_mapping >= 0
    if bool(keep.all()):
        idx = slot_mapping.long()
    else:
        idx = slot_mapping[keep].long()
        kv_c, k_pe = kv_c[keep], k_pe[keep]
    flat[:, :L].index_copy_(0, idx, kv_c.to(cache.dtype))
    flat[:, L:].index_copy_(0, idx, k_pe.to(cache.dtype))


def mla_preprocess_cpu(x: Tensor, q_a_weight: Tensor | None, q_a_scale: Tensor | None, q_a_offset: Tensor | None,
                       q_a_norm: Tensor | None, q_b_weight: Tensor, q_b_scale: Tensor | None,
                       q_b_offset: Tensor | None, kv_a_weight: Tensor, kv_a_scale: Tensor | None,
                       kv_a_offset: Tensor | None, kv_norm: Tensor, w_uk: Tensor, cos: Tensor, sin: Tensor,
                       kv_cache: Tensor | None, slot_mapping: Tensor | None, q_eps: float, kv_eps: float,
                       rope_mode: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (q_abs [T, H, L], q_pe [T, H, R], kv_c [T, L], k_pe [T, R], q_resid); arguments as the op's
    (already checked by the caller, `ops/mla_preprocess/ops.py`)."""
    T = x.shape[0]
    H, nope, L = w_uk.shape
    if q_a_weight is not None:
        q_resid = rms_norm(ref.linear(x, q_a_weight, q_a_scale, q_a_offset), q_a_norm, q_eps)  # [T, q_lora]
        q = ref.linear(q_resid, q_b_weight, q_b_scale, q_b_offset)
    else:
        q_resid = x.new_zeros(T, 0)
        q = ref.linear(x, q_b_weight, q_b_scale, q_b_offset)
    q = q.view(T, H, -1)  # [T, H, nope + R]
    R = q.shape[-1] - nope
    kv = ref.linear(x, kv_a_weight, kv_a_scale, kv_a_offset)  # [T, L + R]
    kv_c = rms_norm(kv[:, :L], kv_norm, kv_eps)  # [T, L]
    q_pe = rope_into(q.new_empty(T, H, R), q[..., nope:], cos, sin, rope_mode)
    k_pe = rope_into(kv.new_empty(T, 1, R), kv[:, None, L:], cos, sin, rope_mode)[:, 0]
    q_abs = q.new_empty(T, H, L)
    torch.bmm(q[..., :nope].transpose(0, 1), w_uk, out=q_abs.transpose(0, 1))  # [H, T, nope] @ [H, nope, L]
    if kv_cache is not None:
        write_latent(kv_cache, kv_c, k_pe, slot_mapping)
    return q_abs, q_pe, kv_c, k_pe, q_resid
