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
| `cp::quant_cache_write` | quantise on the device (torch ops), then `npu_scatter_nd_update_` of the int8 codes and of the fp32 scales |
| the two reads with scale caches (int8) | FIA with `key_antiquant_scale` / `value_antiquant_scale`, per-token modes managed by page attention: 5 (GQA, scales transposed to (blocknum, N, blocksize)), 4 (MLA latent, (blocknum, blocksize)) |
| `cp::gqa_paged_attention_quant`, `cp::mla_attention_quant` | the quantised write, then the read above at causal lengths |

A quantised fp8 cache is refused by name (FIA's key / value take int8, fp16 or bf16).

Everything else (localisation, `lse_rescale`, the model-dtype single-device ops, SFA) keeps the
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


# FIA's per-token antiquant modes managed by page attention (Q_S = 1; torch_npu's page,
# Ascend/op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md): 4 = scales
# (blocknum, blocksize), 5 = per head too, (blocknum, N, blocksize); fp32, int8 key / value.
PER_TOKEN_PAGED = 4
PER_TOKEN_HEAD_PAGED = 5


def _refuse_fp8(op: str, *caches: torch.Tensor) -> None:
    for c in caches:
        if c.dtype != torch.int8:
            raise NotImplementedError(
                f"{op}: torch_npu's fused attention reads a quantised KV cache as int8 with FIA's antiquant "
                f"scales, and this cache is {c.dtype}: FIA takes int8, fp16 or bf16 keys / values, no fp8. Fix: "
                "CPConfig(kv_cache_dtype='int8') on the NPU, or run the fp8 cache on CPU / CUDA (Triton)")


def _per_token_fia(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, kv_heads, op, antiquant=None):
    _refuse_capture(op)
    T, H, D = q.shape
    req = layout.request_index(query_start_loc, T).clamp(min=0).long()
    quant = {}
    if antiquant is not None:  # (key scales, value scales, mode): symmetric codes, no offsets
        k_scale, v_scale, mode = antiquant
        quant = dict(key_antiquant_scale=k_scale, value_antiquant_scale=v_scale, key_antiquant_mode=mode,
                     value_antiquant_mode=mode)
    out, lse = _torch_npu().npu_fused_infer_attention_score(
        q.reshape(T, 1, H, D), k_cache.flatten(2), v_cache.flatten(2), num_heads=H, num_key_value_heads=kv_heads,
        input_layout="BSND", scale=scale, block_table=block_table[req].to(torch.int32),
        block_size=k_cache.shape[1], actual_seq_lengths_kv=kv_lens.long().tolist(),  # host read, see above
        softmax_lse_flag=True, **quant)
    lse = lse.reshape(T, H).float()
    # FIA's LSE for a row without keys is undocumented ("inf is invalid"): -inf, as the reference.
    # FIA's +inf reading of a row without keys (docs/torchair.md) -> -inf (empty), here at the FIA
    # boundary only; a NaN passes and the merge makes its row NaN (decision 47).
    return out.reshape(T, H, -1), torch.where(torch.isposinf(lse), torch.full_like(lse, float("-inf")), lse)


def _paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_scale_cache=None,
                         v_scale_cache=None):
    op = "cp::paged_attention_lse"
    kv_quant.check_pair(k_cache, k_scale_cache, "k_cache")
    kv_quant.check_pair(v_cache, v_scale_cache, "v_cache")
    antiquant = None
    if k_scale_cache is not None:
        _refuse_fp8(op, k_cache, v_cache)
        # [NB, BS, Hkv] -> mode 5's (blocknum, N, blocksize): a transposed copy per call.
        antiquant = (k_scale_cache.transpose(1, 2).contiguous(), v_scale_cache.transpose(1, 2).contiguous(),
                     PER_TOKEN_HEAD_PAGED)
    return _per_token_fia(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_cache.shape[2], op,
                          antiquant)


def _mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale,
                           kv_scale_cache=None):
    op = "cp::mla_partial_attention"
    kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")
    antiquant = None
    if kv_scale_cache is not None:
        _refuse_fp8(op, kv_cache)
        flat = kv_scale_cache.flatten(1)  # [NB, BS, 1] -> mode 4's (blocknum, blocksize), key = value
        antiquant = (flat, flat, PER_TOKEN_PAGED)
    L = q_nope.shape[-1]
    out, lse = _per_token_fia(torch.cat([q_nope, q_pe], -1), kv_cache, kv_cache, block_table, query_start_loc,
                              kv_lens, scale, 1, op, antiquant)
    return out[..., :L].contiguous(), lse


def _quant_cache_write(new, cache, scale_cache, slot_mapping, static_scale=None):
    """cp::quant_cache_write: quantise every row on the device (core/kv_quant.quantize, torch ops),
    then the codes and the scales each through `_cache_write` (-1 slots routed, no host read)."""
    kv_quant.refuse_static_scale("cp::quant_cache_write", static_scale)
    kv_quant.check_pair(cache, scale_cache, "cache")
    _refuse_fp8("cp::quant_cache_write", cache)
    T = slot_mapping.shape[0]
    codes, scales = kv_quant.quantize(new[:T], cache.dtype)  # [T, ..., D], [T, ...]
    _cache_write(codes, cache, slot_mapping)
    _cache_write(scales.reshape(T, scale_cache.shape[2]), scale_cache, slot_mapping)


def _gqa_paged_attention_quant(q, k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, slot_mapping, block_table,
                               seq_lens, query_start_loc, scale, k_static_scale=None, v_static_scale=None):
    kv_quant.refuse_static_scale("cp::gqa_paged_attention_quant", k_static_scale, v_static_scale)
    _refuse_fp8("cp::gqa_paged_attention_quant", k_cache, v_cache)  # before either cache is written
    _quant_cache_write(k, k_cache, k_scale_cache, slot_mapping)
    _quant_cache_write(v, v_cache, v_scale_cache, slot_mapping)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q.shape[0])
    return _paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_scale_cache,
                                v_scale_cache)[0]


def _mla_attention_quant(q_nope, q_pe, kv_c, k_pe, kv_cache, kv_scale_cache, slot_mapping, block_table, seq_lens,
                         query_start_loc, scale, kv_static_scale=None):
    kv_quant.refuse_static_scale("cp::mla_attention_quant", kv_static_scale)
    _quant_cache_write(torch.cat([kv_c, k_pe], -1), kv_cache, kv_scale_cache, slot_mapping)  # one scale per row
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q_nope.shape[0])
    return _mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale,
                                  kv_scale_cache)[0]
