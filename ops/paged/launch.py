"""The accelerator kernels of the cp:: ops, with each op's signature (its `OpDecl.cuda`).

Thin adapters from an op's arguments to the Triton launchers of `cp_compile.ops.kernels`
(fetched, and triton imported, on first call: registration imports no triton), and
`lazy(name)` for the `*_device` functions that already take the op's arguments. The
op family modules name these in their declarations; `registry` registers them.
"""

from __future__ import annotations

import torch

from cp_compile.ops import kernels, layout


# Batches with at least this many tokens per request (prefill, chunked prefill) take the
# query-tiled kernel, which reads each request's pages once per BLOCK_M tokens instead
# of once per token; decode-like batches keep the per-token flash-decode kernel. A
# choice on shapes only (T and B are sizes), so a captured graph keeps one kernel.
PREFILL_TOKENS_PER_REQUEST = 4


def _paged(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale):
    if q.shape[0] >= PREFILL_TOKENS_PER_REQUEST * max(query_start_loc.shape[0] - 1, 1):
        return kernels.paged_prefill_attention_lse_triton(q, k_cache, v_cache, block_table, query_start_loc,
                                                          kv_lens, scale)
    return kernels.paged_attention_with_lse_triton(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)


def paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale):
    return _paged(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)


def mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale):
    L = q_nope.shape[-1]
    return _paged(torch.cat([q_nope, q_pe], -1), kv_cache.unsqueeze(2), kv_cache[..., :L].unsqueeze(2), block_table,
                  query_start_loc, kv_lens, scale)


def lse_rescale(out, lse, lse_all):
    T, G = lse.shape
    total = lse.new_empty(T, G)
    scaled = kernels.lse_rescale_triton(out, lse, lse_all.view(-1, G, T).permute(0, 2, 1), lse_out=total)
    return scaled, total


def lse_combine(outs, lses):
    total = lses.new_empty(lses.shape[1:], dtype=torch.float32)
    return kernels.merge_partials_triton(outs, lses, lse_out=total), total


def dcp_localize_metadata(slot_mapping, query_start_loc, seq_lens, cp, rank, interleave, block_size):
    T = slot_mapping.shape[0]
    lay = dict(cp=cp, rank=rank, interleave=interleave)
    slots = kernels.local_slot_mapping_triton(slot_mapping.long(), **lay, block_size=block_size)
    return (slots, layout.local_len(seq_lens, **lay).to(torch.int32),
            layout.local_causal_lens(query_start_loc, seq_lens, T, **lay),
            layout.local_context_lens(query_start_loc, seq_lens, T, **lay))


def gqa_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start_loc, scale):
    kernels.cache_write_triton(k, k_cache, slot_mapping)
    kernels.cache_write_triton(v, v_cache, slot_mapping)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q.shape[0])
    return paged_attention_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)[0]


def mla_attention(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, query_start_loc, scale):
    kernels.cache_write_triton(torch.cat([kv_c, k_pe], -1), kv_cache, slot_mapping)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q_nope.shape[0])
    return mla_partial_attention(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale)[0]


def lazy(name: str):
    """The kernel launcher / device function `name` of cp_compile.ops.kernels, fetched
    (and triton imported) on first call, not at registration."""

    def call(*args, **kwargs):
        return getattr(kernels, name)(*args, **kwargs)

    call.__name__ = name
    call.__module__ = f"{kernels.__name__}.{kernels._LAUNCHERS[name]}"  # where the function lives (op table)
    return call


def dcp_sparse_indices(topk_indices, cp, rank, interleave, block_size):
    # Vectorised torch (a stable sort, gathers; no host read): runs as it is on the device.
    return layout.global_to_local_indices(topk_indices, cp=cp, rank=rank, interleave=interleave,
                                          block_size=block_size)
