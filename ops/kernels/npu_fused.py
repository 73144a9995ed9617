"""NPU eager kernels from torch_npu's fused ops, for aclgraph capture (torchair `reduce-overhead`).

UNTESTED: no machine here has an NPU (torch_npu cannot even import without CANN).
Imported lazily; `register_npu_fused_kernels()` does nothing unless torch_npu imports.
It overrides, for the "npu" device only, the Triton-Ascend kernels that
`ops/kernels/registry.py` registers, where a torch_npu fused op does the same job
(the same CANN ops the GE converters in `cp_compile/ops/ge/` emit, so eager,
aclgraph and GE graph mode run one kernel per op):

| cp op | torch_npu op |
|---|---|
| `cp::cache_write` | `npu_scatter_nd_update_(cache, [slot // BS, slot % BS], new)` |
| `cp::paged_attention_lse` | `npu_fused_infer_attention_score` (BSND, one batch row per token, `softmax_lse_flag`) |
| `cp::mla_partial_attention` | the same over the whole [c, k_pe] row, first L output columns |
| `cp::lse_combine` | `npu_attention_update(lses, outs, update_type=1)` |

Everything else (localisation, `lse_rescale`, the single-device ops, SFA) keeps the
Triton-Ascend kernel or the torch reference. The argument conventions follow
torch_npu's documentation for these ops and are the ones the GE check verifies for
the GE path; the -1-slot behaviour of `npu_scatter_nd_update_` and FIA's LSE for
an empty shard need a device to confirm (docs/torchair.md).
"""

from __future__ import annotations

import torch

import cp_compile.ops.dcp  # noqa: F401  (defines the ops the kernels are registered for)
from cp_compile.ops import layout

_REGISTERED: list[str] = []


def _torch_npu():
    import torch_npu  # noqa: F401

    return torch_npu


def _cache_write(new, cache, slot_mapping):
    bs = cache.shape[1]
    s = slot_mapping.long()
    idx = torch.stack([torch.div(s, bs, rounding_mode="floor"), s % bs], dim=1)
    _torch_npu().npu_scatter_nd_update_(cache, idx, new)


def _per_token_fia(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, kv_heads):
    T, H, D = q.shape
    req = layout.request_index(query_start_loc, T).clamp(min=0).long()
    out, lse = _torch_npu().npu_fused_infer_attention_score(
        q.reshape(T, 1, H, D), k_cache.flatten(2), v_cache.flatten(2), num_heads=H, num_key_value_heads=kv_heads,
        input_layout="BSND", scale=scale, block_table=block_table[req].to(torch.int32),
        block_size=k_cache.shape[1], actual_seq_lengths_kv=kv_lens.long().tolist(), softmax_lse_flag=True)
    return out.reshape(T, H, -1), lse.reshape(T, H).float()


def _paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale):
    return _per_token_fia(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_cache.shape[2])


def _mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale):
    L = q_nope.shape[-1]
    out, lse = _per_token_fia(torch.cat([q_nope, q_pe], -1), kv_cache, kv_cache, block_table, query_start_loc,
                              kv_lens, scale, 1)
    return out[..., :L].contiguous(), lse


def _lse_combine(outs, lses):
    n, dv = outs.shape[0], outs.shape[-1]
    lses = torch.where(torch.isnan(lses), torch.full_like(lses, float("-inf")), lses.float())
    merged, total = _torch_npu().npu_attention_update([lses[i].reshape(-1) for i in range(n)],
                                                      [outs[i].reshape(-1, dv) for i in range(n)], 1)
    return merged.float().reshape(outs.shape[1:]), total.reshape(lses.shape[1:])


NPU_FUSED_KERNELS = {
    "cp::cache_write": _cache_write,
    "cp::paged_attention_lse": _paged_attention_lse,
    "cp::mla_partial_attention": _mla_partial_attention,
    "cp::lse_combine": _lse_combine,
}


def register_npu_fused_kernels() -> list[str]:
    """Idempotent; '<op>@npu' registrations made, [] when torch_npu does not import."""
    if _REGISTERED:
        return _REGISTERED
    try:
        _torch_npu()
    except (ImportError, OSError, RuntimeError):  # not installed, or no CANN libraries
        return _REGISTERED
    for op, fn in NPU_FUSED_KERNELS.items():
        torch.library.register_kernel(op, "npu", fn)
        _REGISTERED.append(f"{op}@npu")
    return _REGISTERED
