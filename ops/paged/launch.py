"""The accelerator kernels of the paged ops, with each op's signature (their `OpDecl.cuda`).

Thin adapters from an op's arguments to the family's Triton launchers
(`triton_decode.py`, `triton_prefill.py`, `triton_localize.py`, and core's shared
`triton_cache_write.py`), fetched, and triton imported, on first call
(`core/launcher.lazy`): registration imports no triton. `ops.py` names these in its
declarations; `core/registry.py` registers them.
"""

from __future__ import annotations

import torch

from cp_compile.ops.core import kv_quant, layout, paged_cache
from cp_compile.ops.core.launcher import lazy

_decode = lazy("cp_compile.ops.paged.triton_decode", "paged_attention_with_lse_triton")
_prefill = lazy("cp_compile.ops.paged.triton_prefill", "paged_prefill_attention_lse_triton")
_local_slots = lazy("cp_compile.ops.paged.triton_localize", "local_slot_mapping_triton")

# cp::cache_write's kernel: the cache-write launcher core/ shares with the sparse family.
cache_write = lazy("cp_compile.ops.core.triton_cache_write", "cache_write_device")

# Batches with at least this many tokens per request (prefill, chunked prefill) take the
# query-tiled kernel, which reads each request's pages once per BLOCK_M tokens instead
# of once per token; decode-like batches keep the per-token flash-decode kernel. A
# choice on shapes only (T and B are sizes), so a captured graph keeps one kernel.
PREFILL_TOKENS_PER_REQUEST = 4


def _paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
           query_start_loc: torch.Tensor, kv_lens: torch.Tensor, scale: float,
           k_scale_cache: torch.Tensor | None = None,
           v_scale_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    kv_quant.check_pair(k_cache, k_scale_cache, "k_cache")
    kv_quant.check_pair(v_cache, v_scale_cache, "v_cache")
    scales = {} if k_scale_cache is None else dict(k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache)
    # Quantised caches (issue 39) take the same choice: both kernels dequantise on load.
    if q.shape[0] >= PREFILL_TOKENS_PER_REQUEST * max(query_start_loc.shape[0] - 1, 1):
        return _prefill(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, **scales)
    return _decode(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, **scales)


def paged_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                        query_start_loc: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                        k_scale_cache: torch.Tensor | None = None,
                        v_scale_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return _paged(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_scale_cache, v_scale_cache)


def mla_partial_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                          block_table: torch.Tensor, query_start_loc: torch.Tensor, kv_lens: torch.Tensor,
                          scale: float, kv_scale_cache: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    L = q_nope.shape[-1]
    return _paged(torch.cat([q_nope, q_pe], -1), kv_cache.unsqueeze(2), kv_cache[..., :L].unsqueeze(2), block_table,
                  query_start_loc, kv_lens, scale, kv_scale_cache, kv_scale_cache)


def dcp_localize_metadata(slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          cp: int, rank: int, interleave: int,
                          block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T = slot_mapping.shape[0]
    lay = dict(cp=cp, rank=rank, interleave=interleave)
    slots = _local_slots(slot_mapping.long(), **lay, block_size=block_size)
    return (slots, layout.local_len(seq_lens, **lay).to(torch.int32),
            layout.local_causal_lens(query_start_loc, seq_lens, T, **lay),
            layout.local_context_lens(query_start_loc, seq_lens, T, **lay))


def _static_write(new: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor, scale_cache: torch.Tensor,
                  static_scale: torch.Tensor | None) -> None:
    """The Triton quantised write computes the dynamic scale; a checkpoint's static scale
    (decision 71) is written by the torch reference (same arithmetic as the CPU path)."""
    if static_scale is None:
        cache_write(new, cache, slot_mapping, scale_cache)
    else:
        paged_cache.write_cache(cache, new, slot_mapping, scale_cache, static_scale)


def quant_cache_write(new: torch.Tensor, cache: torch.Tensor, scale_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, static_scale: torch.Tensor | None = None) -> None:
    _static_write(new, cache, slot_mapping, scale_cache, static_scale)


def gqa_paged_attention_quant(q, k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, slot_mapping, block_table,
                              seq_lens, query_start_loc, scale, k_static_scale=None, v_static_scale=None):
    if k_static_scale is None and v_static_scale is None:
        return gqa_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start_loc,
                                   scale, k_scale_cache, v_scale_cache)
    kv_quant.check_pair(k_cache, k_scale_cache, "k_cache")  # before either cache is written
    kv_quant.check_pair(v_cache, v_scale_cache, "v_cache")
    _static_write(k, k_cache, slot_mapping, k_scale_cache, k_static_scale)
    _static_write(v, v_cache, slot_mapping, v_scale_cache, v_static_scale)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q.shape[0])
    return paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale,
                               k_scale_cache, v_scale_cache)[0]


def mla_attention_quant(q_nope, q_pe, kv_c, k_pe, kv_cache, kv_scale_cache, slot_mapping, block_table, seq_lens,
                        query_start_loc, scale, kv_static_scale=None):
    if kv_static_scale is None:
        return mla_attention(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                             query_start_loc, scale, kv_scale_cache)
    _static_write(torch.cat([kv_c, k_pe], -1), kv_cache, slot_mapping, kv_scale_cache, kv_static_scale)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q_nope.shape[0])
    return mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale,
                                 kv_scale_cache)[0]


def gqa_paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                        k_scale_cache: torch.Tensor | None = None,
                        v_scale_cache: torch.Tensor | None = None) -> torch.Tensor:
    kv_quant.check_pair(k_cache, k_scale_cache, "k_cache")  # before either cache is written
    kv_quant.check_pair(v_cache, v_scale_cache, "v_cache")
    cache_write(k, k_cache, slot_mapping, k_scale_cache)
    cache_write(v, v_cache, slot_mapping, v_scale_cache)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q.shape[0])
    return paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale,
                               k_scale_cache, v_scale_cache)[0]


def mla_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                  kv_cache: torch.Tensor, slot_mapping: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                  kv_scale_cache: torch.Tensor | None = None) -> torch.Tensor:
    cache_write(torch.cat([kv_c, k_pe], -1), kv_cache, slot_mapping, kv_scale_cache)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q_nope.shape[0])
    return mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale,
                                 kv_scale_cache)[0]
