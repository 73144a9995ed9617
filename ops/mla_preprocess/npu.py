"""NPU eager kernel of `cp::mla_preprocess`: torch_npu's fused MLA prolog (MLAPO).

UNTESTED: no machine here has an NPU (torch_npu needs CANN). Imported lazily, and
registered for the "npu" device only with the other torch_npu fused kernels
(declared as the op's `npu` kernel, registered by `registry` only when torch_npu imports).

`torch_npu.npu_mla_prolog_v3` (docs: https://gitcode.com/Ascend/op-plugin/blob/7.3.0/docs/context/torch_npu-npu_mla_prolog_v2.md,
v2 points to v3 for in-place caches; aclnnMlaProlog in the CANN API reference) computes
x -> W^DQ -> RmsNorm -> W^UQ|W^QR (rope on the rope columns) -> W^UK, and x -> W^DKV|W^KR
-> RmsNorm / rope -> two paged caches (k^C, k^R) at `cache_index`. Used when the layer
fits it: q-LoRA, float bf16 weights, a cache write, and the half-split (neox) rope
(assumed from the docs' ROPE formula; interleaved layouts need permuted rope
columns, which vLLM-Ascend does at weight load). Our one latent row [kv_c | k_pe]
is handed over as its two column views (k^C = row[:L], k^R = row[L:]). The op does
not return kv_c / k_pe: they are read back from the rows just written (zeros where
the slot is -1, i.e. where this rank stores nothing; the pass folds the write only
where nothing else reads them), and q_resid (the DSA indexer's input) is
recomputed with one more GEMM. Anything else runs the Triton-Ascend kernel
(`mla_preprocess_tail.mla_preprocess_device`).
"""

from __future__ import annotations

import torch

from cp_compile.ops.mla_preprocess import launch
from cp_compile.ops.mla_preprocess import reference as ref


def _fits(x, q_a_weight, q_a_scale, q_b_scale, kv_a_scale, kv_cache, rope_mode) -> bool:
    return (q_a_weight is not None and kv_cache is not None and rope_mode == "neox" and x.dtype == torch.bfloat16
            and q_a_scale is None and q_b_scale is None and kv_a_scale is None)


def mla_preprocess_npu(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale, q_b_offset,
                       kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos, sin, kv_cache, slot_mapping,
                       q_eps, kv_eps, rope_mode):
    if not _fits(x, q_a_weight, q_a_scale, q_b_scale, kv_a_scale, kv_cache, rope_mode):
        return launch.mla_preprocess(x, q_a_weight, q_a_scale, q_a_offset, q_a_norm, q_b_weight, q_b_scale,
                                     q_b_offset, kv_a_weight, kv_a_scale, kv_a_offset, kv_norm, w_uk, cos,
                                     sin, kv_cache, slot_mapping, q_eps, kv_eps, rope_mode)
    import torch_npu

    T = x.shape[0]
    L = w_uk.shape[-1]
    NB, BS, width = kv_cache.shape
    rows = kv_cache.view(NB, BS, 1, width)
    full_cos = torch.cat([cos, cos], dim=-1).to(x.dtype)  # [T, R]: both halves of a neox pair
    full_sin = torch.cat([sin, sin], dim=-1).to(x.dtype)
    q_abs, q_pe = torch_npu.npu_mla_prolog_v3(
        x, q_a_weight.t(), q_b_weight.t(), w_uk, kv_a_weight.t(), q_a_norm, kv_norm, full_sin, full_cos,
        slot_mapping, rows[..., :L], rows[..., L:], rmsnorm_epsilon_cq=q_eps, rmsnorm_epsilon_ckv=kv_eps,
        cache_mode="PA_BSND")[:2]
    keep = (slot_mapping >= 0)[:, None]
    latent = torch.where(keep, kv_cache.view(-1, width)[slot_mapping.clamp(min=0)], 0)  # [T, L + R]
    q_resid = ref.rms_norm(torch.nn.functional.linear(x, q_a_weight), q_a_norm, q_eps)
    return (q_abs.reshape(T, -1, L), q_pe.reshape(T, q_abs.reshape(T, -1, L).shape[1], -1),
            latent[:, :L].contiguous(), latent[:, L:].contiguous(), q_resid)
