"""NPU eager kernels of the paged ops from torch_npu's fused ops, for aclgraph capture
(torchair `reduce-overhead`).

Not run on an NPU (none here; torch_npu cannot import without CANN): tests/ops/test_npu_fused_kernels.py
runs these functions against a torch_npu stand-in that records the calls and enforces the
documented preconditions (in-range, unique scatter indices).
`ops.py` declares these as the ops' `npu` kernels (core/spec.py); `core/registry.py`
registers them for the "npu" device when torch_npu imports, instead of the
Triton-Ascend kernel, where a torch_npu fused op does the same job (the same CANN ops
the family's GE converters, `ge.py` / `ge_cache.py`, emit, so eager, aclgraph and GE
graph mode run one kernel per op). The other families' torch_npu kernels:
`merge/npu.py` (`cp::lse_combine`), `mla_preprocess/npu.py` (`cp::mla_preprocess`).

| cp op | torch_npu op |
|---|---|
| `cp::cache_write` | `npu_scatter_nd_update_(cache, [slot // BS, slot % BS], new)` |
| `cp::paged_attention_lse` | `npu_fused_infer_attention_score` (BSND, one batch row per token, `softmax_lse_flag`) |
| `cp::mla_partial_attention` | the same over the whole [c, k_pe] row, first L output columns |

Everything else (localisation, `lse_rescale`, the single-device ops, SFA) keeps the
Triton-Ascend kernel or the torch reference. The argument conventions follow
torch_npu's documentation for these ops and are the ones the GE check verifies for
the GE path (docs/torchair.md).

aclgraph capture (issue 21):
- `cp::cache_write` reads nothing on the host. Slots -1 (another DCP rank's token,
  padding) are routed explicitly: each such row is sent to a distinct slot no valid
  row writes this step and writes back that slot's current content, so every index
  handed to `npu_scatter_nd_update_` is in range and unique (CANN documents no
  out-of-range behaviour).
- `cp::paged_attention_lse` / `cp::mla_partial_attention`: torch_npu's
  `npu_fused_infer_attention_score` takes `actual_seq_lengths_kv` as a host list
  (`SymInt[]`); a capture would freeze one step's lengths into every replay. These
  kernels refuse to run inside a capture (`NpuCaptureUnsupported`, the fix in the
  message) and read the lengths on the host only outside one.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core import kv_quant, layout
from cp_compile.ops.core.npu import torch_npu as _torch_npu


class NpuCaptureUnsupported(RuntimeError):
    """An NPU fused kernel that needs a host value was called inside an aclgraph capture."""


def route_invalid_slots(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[T] slots (-1 = do not write) -> [T] distinct targets in [0, num_slots): a valid
    row keeps its slot, the j-th invalid row gets the j-th slot no valid row uses.
    Device ops only (sort, cumsum, searchsorted); needs num_slots >= T, which holds
    whenever every token of the step can have a slot. Valid slots must be distinct.

    With the valid slots sorted, s_i - i counts the free slots below s_i, so the k-th
    free slot is k + #{i : s_i - i <= k}.
    """
    T = slots.shape[0]
    s = slots.long()
    valid = s >= 0
    big = num_slots + T
    ordered = torch.sort(torch.where(valid, s, torch.full_like(s, big))).values
    steps = torch.arange(T, device=s.device)
    gaps = torch.where(ordered < big, ordered - steps, torch.full_like(s, 2 * big))  # non-decreasing
    k = (torch.cumsum((~valid).long(), 0) - 1).clamp(min=0)  # rank of each invalid row
    free = k + torch.searchsorted(gaps, k, right=True)
    return torch.where(valid, s, free)


def _cache_write(new, cache, slot_mapping):
    NB, bs = cache.shape[0], cache.shape[1]
    s = slot_mapping.long()
    target = route_invalid_slots(s, NB * bs)
    flat = cache.view(NB * bs, *cache.shape[2:])
    valid = (s >= 0).view(-1, *([1] * (new.dim() - 1)))
    rows = torch.where(valid, new.to(cache.dtype), flat[target])  # invalid rows write back what is there
    idx = torch.stack([torch.div(target, bs, rounding_mode="floor"), target % bs], dim=1)
    _torch_npu().npu_scatter_nd_update_(cache, idx, rows)


def _refuse_capture(op: str) -> None:
    npu = _torch_npu().npu
    if npu.is_current_stream_capturing():
        raise NpuCaptureUnsupported(
            f"{op}: torch_npu.npu_fused_infer_attention_score takes actual_seq_lengths_kv as a host list "
            "(SymInt[]), so an aclgraph capture would freeze this step's key lengths into every replay. Fix: "
            "compile with torchair_mode='max-autotune' (the GE graph takes the lengths as a tensor), or keep "
            "this op out of the captured region")


def _per_token_fia(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, kv_heads, op):
    _refuse_capture(op)
    T, H, D = q.shape
    req = layout.request_index(query_start_loc, T).clamp(min=0).long()
    out, lse = _torch_npu().npu_fused_infer_attention_score(
        q.reshape(T, 1, H, D), k_cache.flatten(2), v_cache.flatten(2), num_heads=H, num_key_value_heads=kv_heads,
        input_layout="BSND", scale=scale, block_table=block_table[req].to(torch.int32),
        block_size=k_cache.shape[1], actual_seq_lengths_kv=kv_lens.long().tolist(),  # host read, see above
        softmax_lse_flag=True)
    lse = lse.reshape(T, H).float()
    # FIA's LSE for a row without keys is undocumented ("inf is invalid"): -inf, as the reference.
    # FIA's +inf reading of a row without keys (docs/torchair.md) -> -inf (empty), here at the FIA
    # boundary only; a NaN passes and the merge makes its row NaN (decision 47).
    return out.reshape(T, H, -1), torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)


def _paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_scale_cache=None,
                         v_scale_cache=None):
    kv_quant.refuse_quantized("cp::paged_attention_lse", "torch_npu's fused attention", k_scale_cache, v_scale_cache)
    return _per_token_fia(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_cache.shape[2],
                          "cp::paged_attention_lse")


def _mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale,
                           kv_scale_cache=None):
    kv_quant.refuse_quantized("cp::mla_partial_attention", "torch_npu's fused attention", kv_scale_cache)
    L = q_nope.shape[-1]
    out, lse = _per_token_fia(torch.cat([q_nope, q_pe], -1), kv_cache, kv_cache, block_table, query_start_loc,
                              kv_lens, scale, 1, "cp::mla_partial_attention")
    return out[..., :L].contiguous(), lse
