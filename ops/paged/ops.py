"""The paged attention ops (docs/architecture.md §4, §5): the single-device attention
custom ops that models call, and the DCP building blocks over a paged cache.

Every op is a `torch.library` custom op in the `cp` namespace: dynamo keeps each one
as a single graph node (which the DCP passes rewrite), `mutates_args` names exactly
the caches the op writes (so functionalization and Inductor's reinplacing keep the
cache update in place), and a fake implementation gives shapes under tracing.

The implementation registered here is the torch reference (`reference.py`, the tests'
oracle); the CPU kernels (`cpu.py`, declared as `cpu=`) and the device kernels
(Triton, `launch.py`; torch_npu, `npu.py`) override it per device with `register_kernel`.
Metadata is global and flattened (vLLM style): `T` tokens over `B` requests,
`query_start_loc[B+1]`, `seq_lens[B]` (context + new), `block_table[B, nb]`,
`slot_mapping[T]` (-1 = skip). Tokens at or past `query_start_loc[-1]` are padding
and produce zeros.

The DCP building blocks are small enough for a pass to place on its own: metadata
localisation (once per forward), local cache write, partial attention over the local
shard returning (out, lse). Collectives are *not* inside these ops: the compositions
in `cp_compile.ops.parallel.dcp` issue them as `_c10d_functional` ops so they stay
visible graph nodes; the LSE merges of the partials are the `merge` family.

Callers use `torch.ops.cp.<name>`; there are no Python wrappers.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from cp_compile.ops.core import kv_quant, layout, paged_cache
from cp_compile.ops.core.spec import GE, TRITON_ASCEND, OpDecl
from cp_compile.ops.paged import cpu, launch, npu, reference


# --------------------------------------------------------------------------- GQA


@torch.library.custom_op("cp::gqa_paged_attention", mutates_args=("k_cache", "v_cache"))
def gqa_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]   new keys of this step
    v: torch.Tensor,  # [T, Hkv, Dv]  new values of this step
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D]  written in place
    v_cache: torch.Tensor,  # [NB, BS, Hkv, Dv] written in place
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    block_table: torch.Tensor,  # [B, nb] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
) -> torch.Tensor:
    """Write the new k/v into the paged caches, then causal GQA attention -> [T, Hq, Dv].

    Token t at request-local position pos attends keys 0..pos of its request, read
    back from the cache (so the new tokens are seen exactly as stored, in the cache
    dtype). Query head h reads KV head h // (Hq // Hkv). Output in q's dtype.
    """
    return _gqa_step(reference.paged_attention_with_lse, q, k, v, k_cache, v_cache, slot_mapping, block_table,
                     seq_lens, query_start_loc, scale)


# A quantised cache (CPConfig.kv_cache_dtype, issue 39) has its own ops, whose scale caches are
# required arguments: torchair's auto_functionalized_v2 converter cannot take an Optional
# mutable argument left None (it calls view_copy on None), so the model-dtype ops keep their
# schemas and GE graphs exactly as they were (decision 66).
@torch.library.custom_op("cp::gqa_paged_attention_quant",
                         mutates_args=("k_cache", "v_cache", "k_scale_cache", "v_scale_cache"))
def gqa_paged_attention_quant(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, Dv]
    k_cache: torch.Tensor,  # [NB, BS, Hkv, D] int8 / float8_e4m3fn, written in place
    v_cache: torch.Tensor,  # [NB, BS, Hkv, Dv] int8 / float8_e4m3fn, written in place
    k_scale_cache: torch.Tensor,  # [NB, BS, Hkv] fp32, written in place
    v_scale_cache: torch.Tensor,  # [NB, BS, Hkv] fp32, written in place
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    k_static_scale: Optional[torch.Tensor] = None,  # [] fp32: a checkpoint's per-layer k_scale (decision 71)
    v_static_scale: Optional[torch.Tensor] = None,  # [] fp32: its v_scale
) -> torch.Tensor:
    """`cp::gqa_paged_attention` over a quantised cache: the write quantises each token's row per
    KV head (its scale into the scale caches), the attention dequantises on load. With static
    scales every row is written with the layer's scale instead of its dynamic amax scale."""
    return _gqa_step(reference.paged_attention_with_lse, q, k, v, k_cache, v_cache, slot_mapping, block_table,
                     seq_lens, query_start_loc, scale, k_scale_cache, v_scale_cache, k_static_scale, v_static_scale)


def _gqa_paged_attention_quant_cpu(q, k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, slot_mapping,
                                   block_table, seq_lens, query_start_loc, scale, k_static_scale=None,
                                   v_static_scale=None):
    return _gqa_step(cpu.paged_attention_lse, q, k, v, k_cache, v_cache, slot_mapping, block_table,
                     seq_lens, query_start_loc, scale, k_scale_cache, v_scale_cache, k_static_scale, v_static_scale)


@gqa_paged_attention_quant.register_fake
def _(q, k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, slot_mapping, block_table, seq_lens, query_start_loc,
      scale, k_static_scale=None, v_static_scale=None):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


def _gqa_step(attend, q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start_loc, scale,
              k_scale_cache=None, v_scale_cache=None, k_static_scale=None, v_static_scale=None):
    """Check, write the caches, attend causally with `attend` (the reference, or the CPU kernel)."""
    paged_cache.check_paged_step((k_cache, v_cache), slot_mapping, block_table, seq_lens, query_start_loc,
                               op="cp::gqa_paged_attention")
    kv_quant.check_pair(k_cache, k_scale_cache, "k_cache")  # before either cache is written
    kv_quant.check_pair(v_cache, v_scale_cache, "v_cache")
    kv_quant.check_static_scale(k_static_scale, "k_static_scale")
    kv_quant.check_static_scale(v_static_scale, "v_static_scale")
    paged_cache.write_cache(k_cache, k, slot_mapping, k_scale_cache, k_static_scale)
    paged_cache.write_cache(v_cache, v, slot_mapping, v_scale_cache, v_static_scale)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q.shape[0])  # [T], 0 for padding
    out, _ = attend(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_scale_cache, v_scale_cache)
    return out  # fresh tensor (built with torch.zeros inside), never an alias of q


def _gqa_paged_attention_cpu(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start_loc,
                             scale):
    return _gqa_step(cpu.paged_attention_lse, q, k, v, k_cache, v_cache, slot_mapping, block_table,
                     seq_lens, query_start_loc, scale)


@gqa_paged_attention.register_fake
def _gqa_paged_attention_fake(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens,
                              query_start_loc, scale):
    # Dv comes from the value tensor: GQA may use a different value head dim.
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


# --------------------------------------------------------------------------- MLA



@torch.library.custom_op("cp::mla_attention", mutates_args=("kv_cache",))
def mla_attention(
    q_nope: torch.Tensor,  # [T, H, L]  already absorbed (q_nope @ W_UK)
    q_pe: torch.Tensor,  # [T, H, R]
    kv_c: torch.Tensor,  # [T, L]  new latent of this step
    k_pe: torch.Tensor,  # [T, R]  new rope key of this step
    kv_cache: torch.Tensor,  # [NB, BS, L+R] written in place
    slot_mapping: torch.Tensor,  # [T] int64
    block_table: torch.Tensor,  # [B, nb] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA: causal MQA over the cached [c; k_pe] with V = c -> latent out [T, H, L].

    With W_UK absorbed into the query and W_UV applied by the model after this op,
    every head shares one key ([L+R]) and one value (the first L columns) per token.
    """
    return _mla_step(reference.mla_attention_with_lse, q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                     block_table, seq_lens, query_start_loc, scale)


@torch.library.custom_op("cp::mla_attention_quant", mutates_args=("kv_cache", "kv_scale_cache"))
def mla_attention_quant(
    q_nope: torch.Tensor,  # [T, H, L]
    q_pe: torch.Tensor,  # [T, H, R]
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [NB, BS, L+R] int8 / float8_e4m3fn, written in place
    kv_scale_cache: torch.Tensor,  # [NB, BS, 1] fp32, written in place: one scale per token for [c | k_pe]
    slot_mapping: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    kv_static_scale: Optional[torch.Tensor] = None,  # [] fp32: a checkpoint's latent scale (k_scale; decision 71)
) -> torch.Tensor:
    """`cp::mla_attention` over a quantised latent cache (issue 39)."""
    return _mla_step(reference.mla_attention_with_lse, q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                     block_table, seq_lens, query_start_loc, scale, kv_scale_cache, kv_static_scale)


def _mla_attention_quant_cpu(q_nope, q_pe, kv_c, k_pe, kv_cache, kv_scale_cache, slot_mapping, block_table,
                             seq_lens, query_start_loc, scale, kv_static_scale=None):
    return _mla_step(cpu.mla_attention_lse, q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                     block_table, seq_lens, query_start_loc, scale, kv_scale_cache, kv_static_scale)


@mla_attention_quant.register_fake
def _(q_nope, q_pe, kv_c, k_pe, kv_cache, kv_scale_cache, slot_mapping, block_table, seq_lens, query_start_loc,
      scale, kv_static_scale=None):
    return torch.empty_like(q_nope, memory_format=torch.contiguous_format)


def _mla_step(attend, q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, query_start_loc,
              scale, kv_scale_cache=None, kv_static_scale=None):
    """Check, write the latent cache, attend causally with `attend` (the reference, or the CPU kernel)."""
    paged_cache.check_paged_step((kv_cache,), slot_mapping, block_table, seq_lens, query_start_loc,
                               op="cp::mla_attention")
    paged_cache.write_latent(kv_cache, kv_c, k_pe, slot_mapping, kv_scale_cache, kv_static_scale)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q_nope.shape[0])
    return attend(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale, kv_scale_cache)[0]


def _mla_attention_cpu(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, query_start_loc,
                       scale):
    return _mla_step(cpu.mla_attention_lse, q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                     block_table, seq_lens, query_start_loc, scale)


@mla_attention.register_fake
def _mla_attention_fake(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                        query_start_loc, scale):
    return torch.empty_like(q_nope, memory_format=torch.contiguous_format)



# --------------------------------------------------------------------------- DCP building blocks


@torch.library.custom_op("cp::dcp_localize_metadata", mutates_args=())
def dcp_localize_metadata(slot_mapping: Tensor, query_start_loc: Tensor, seq_lens: Tensor, cp: int, rank: int,
                          interleave: int, block_size: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Global metadata -> this rank's view, computed once per forward for all layers.

    Returns (local_slot_mapping [T] int64, local_seq_lens [B] int32,
    local_causal_lens [T] int32, local_context_lens [T] int32). `block_size` is the
    per-rank page size (virtual blocks hold block_size * cp tokens; cp: the cache's
    context-parallel group size, pcp * dcp).
    """
    T = slot_mapping.shape[0]
    lay = dict(cp=cp, rank=rank, interleave=interleave)
    slots = layout.local_slot_mapping(slot_mapping.long(), **lay, block_size=block_size)
    seq = layout.local_len(seq_lens, **lay).to(torch.int32)
    causal = layout.local_causal_lens(query_start_loc, seq_lens, T, **lay)
    ctx = layout.local_context_lens(query_start_loc, seq_lens, T, **lay)
    return slots, seq, causal, ctx


@dcp_localize_metadata.register_fake
def _(slot_mapping, query_start_loc, seq_lens, cp, rank, interleave, block_size):
    T = slot_mapping.shape[0]
    return (slot_mapping.new_empty(T, dtype=torch.int64), seq_lens.new_empty(seq_lens.shape, dtype=torch.int32),
            slot_mapping.new_empty(T, dtype=torch.int32), slot_mapping.new_empty(T, dtype=torch.int32))


@torch.library.custom_op("cp::cache_write", mutates_args=("cache",))
def cache_write(new: Tensor, cache: Tensor, slot_mapping: Tensor) -> None:
    """cache[slot] = new[t] for tokens with slot >= 0; with a local slot mapping this
    stores only this rank's tokens. new [T, ...], cache [NB, BS, ...]."""
    paged_cache.write_cache(cache, new, slot_mapping)


@cache_write.register_fake
def _(new, cache, slot_mapping):
    return None


@torch.library.custom_op("cp::quant_cache_write", mutates_args=("cache", "scale_cache"))
def quant_cache_write(new: Tensor, cache: Tensor, scale_cache: Tensor, slot_mapping: Tensor,
                      static_scale: Optional[Tensor] = None) -> None:
    """`cp::cache_write` into an int8 / fp8 cache: each row stored quantised, its fp32 scale in
    `scale_cache` ([NB, BS, rows]) at the same slot (issue 39); with `static_scale` ([] fp32, a
    checkpoint's per-layer scale, decision 71) every row takes that scale."""
    paged_cache.write_cache(cache, new, slot_mapping, scale_cache, static_scale)


@quant_cache_write.register_fake
def _(new, cache, scale_cache, slot_mapping, static_scale=None):
    return None


@torch.library.custom_op("cp::paged_attention_lse", mutates_args=())
def paged_attention_lse(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, query_start_loc: Tensor,
                        kv_lens: Tensor, scale: float, k_scale_cache: Optional[Tensor] = None,
                        v_scale_cache: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Partial GQA attention over the local shard: token t attends local positions
    0..kv_lens[t]-1 of its request. q [T,Hq,D] (may be a gathered, strided view),
    caches [NB,BS,Hkv,D|Dv] -> out [T,Hq,Dv] (q dtype), lse [T,Hq] fp32 (-inf if empty).
    Quantised caches are dequantised on load with their scales ([NB,BS,Hkv] fp32)."""
    kv_quant.check_pair(k_cache, k_scale_cache, "k_cache")
    kv_quant.check_pair(v_cache, v_scale_cache, "v_cache")
    return reference.paged_attention_with_lse(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale,
                                              k_scale_cache, v_scale_cache)


@paged_attention_lse.register_fake
def _(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale, k_scale_cache=None, v_scale_cache=None):
    T, H = q.shape[0], q.shape[1]
    return q.new_empty(T, H, v_cache.shape[-1]), q.new_empty(T, H, dtype=torch.float32)


@torch.library.custom_op("cp::mla_partial_attention", mutates_args=())
def mla_partial_attention(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                          query_start_loc: Tensor, kv_lens: Tensor, scale: float,
                          kv_scale_cache: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """Partial absorbed-MLA attention over the local latent shard.
    q_nope [T,H,L], q_pe [T,H,R], kv_cache [NB,BS,L+R] -> out [T,H,L], lse [T,H] fp32.
    A quantised latent is dequantised on load with its per-token scales ([NB,BS,1] fp32)."""
    kv_quant.check_pair(kv_cache, kv_scale_cache, "kv_cache")
    return reference.mla_attention_with_lse(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale,
                                            kv_scale_cache)


@mla_partial_attention.register_fake
def _(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale, kv_scale_cache=None):
    T, H, L = q_nope.shape
    return q_nope.new_empty(T, H, L), q_nope.new_empty(T, H, dtype=torch.float32)



# Every op above with a single-device cache assumes its layout. Under DCP or PCP the
# caches are laid out differently (sharded latents and K/V), so a pass must replace or
# claim each of these nodes; the pipeline's final check (passes/unsharded_attention.py)
# refuses a graph that still holds one. A new single-device attention op goes in this
# list (the sparse family has its own; `core/catalog.py` joins them).
SINGLE_DEVICE_ATTENTION_OPS: tuple[torch._ops.OpOverloadPacket, ...] = (
    torch.ops.cp.gqa_paged_attention,
    torch.ops.cp.mla_attention,
    torch.ops.cp.gqa_paged_attention_quant,
    torch.ops.cp.mla_attention_quant,
)
# The quantised ops on the NPU (decision 70): torch_npu's FIA with its int8 antiquant inputs
# (npu.py) in eager / aclgraph mode, and GE converters (ge.py, ge_cache.py) in graph mode; fp8
# pages are refused by name on both (FIA takes no fp8 key / value). Not through Triton-Ascend:
# with quantised launches added to the lowering check, the int8 cache write died in
# triton-adapter-opt (SIGABRT at linalg) and every fp8 kernel failed at TTIR ("unexpected type
# fp8"), so the NPU kernels are the torch_npu ones below, never the CUDA entries.


# ----------------------------------------------------------------------------- declarations (core/spec.py)
# Every piece of every op above: kernels per device, GE converter, profile bucket.
OPS = (
    OpDecl(gqa_paged_attention, cuda=launch.gqa_paged_attention, npu=TRITON_ASCEND,
           ge=GE("ge", "ScatterNdUpdate", "FusedInferAttentionScore"), profile="attention",
           cpu=_gqa_paged_attention_cpu),
    OpDecl(mla_attention, cuda=launch.mla_attention, npu=TRITON_ASCEND,
           ge=GE("ge", "ScatterNdUpdate", "FusedInferAttentionScore"), profile="attention",
           cpu=_mla_attention_cpu),
    OpDecl(dcp_localize_metadata, cuda=launch.dcp_localize_metadata, npu=TRITON_ASCEND,
           ge=GE("ge_cache", "FloorDiv", "FloorMod", "SelectV2"), profile="dcp_local"),
    OpDecl(cache_write, cuda=launch.cache_write, npu=npu._cache_write,
           ge=GE("ge_cache", "ScatterNdUpdate"), profile="attention"),
    OpDecl(paged_attention_lse, cuda=launch.paged_attention_lse, npu=npu._paged_attention_lse,
           ge=GE("ge", "FusedInferAttentionScore"), profile="attention",
           cpu=cpu.paged_attention_lse),
    OpDecl(mla_partial_attention, cuda=launch.mla_partial_attention, npu=npu._mla_partial_attention,
           ge=GE("ge", "FusedInferAttentionScore"), profile="attention", cpu=cpu.mla_attention_lse),
    OpDecl(gqa_paged_attention_quant, cuda=launch.gqa_paged_attention_quant, npu=npu._gqa_paged_attention_quant,
           ge=GE("ge", "Round", "ScatterNdUpdate", "TransposeD", "FusedInferAttentionScore"), profile="attention",
           cpu=_gqa_paged_attention_quant_cpu),
    OpDecl(mla_attention_quant, cuda=launch.mla_attention_quant, npu=npu._mla_attention_quant,
           ge=GE("ge", "Round", "ScatterNdUpdate", "FusedInferAttentionScore"), profile="attention",
           cpu=_mla_attention_quant_cpu),
    OpDecl(quant_cache_write, cuda=launch.quant_cache_write, npu=npu._quant_cache_write,
           ge=GE("ge_cache", "ReduceMaxD", "Round", "ScatterNdUpdate"), profile="attention"),
)
