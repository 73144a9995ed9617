"""Single-device attention custom ops that models call (docs/architecture.md §4).

Every op is a `torch.library` custom op in the `cp` namespace: dynamo keeps each one
as a single graph node (which the DCP passes rewrite), `mutates_args` names exactly
the caches the op writes (so functionalization and Inductor's reinplacing keep the
cache update in place), and a fake implementation gives shapes under tracing.

The implementation registered here is the torch reference (the tests' oracle); the
CPU kernels (`ops/cpu_attention.py`, declared as `cpu=`) and the device kernels
(Triton) override it per device with `register_kernel`.
Metadata is global and flattened (vLLM style): `T` tokens over `B` requests,
`query_start_loc[B+1]`, `seq_lens[B]` (context + new), `block_table[B, nb]`,
`slot_mapping[T]` (-1 = skip). Tokens at or past `query_start_loc[-1]` are padding
and produce zeros (attention) or -1 rows (indexer).

Callers use `torch.ops.cp.<name>`; there are no Python wrappers.
"""

from __future__ import annotations

import torch

from cp_compile.ops import cpu_attention, layout, reference
from cp_compile.ops.kernels import launch, npu_fused
from cp_compile.ops.spec import GE, TRITON_ASCEND, OpDecl


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


def _gqa_step(attend, q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start_loc, scale):
    """Check, write the caches, attend causally with `attend` (the reference, or the CPU kernel)."""
    reference.check_paged_step((k_cache, v_cache), slot_mapping, block_table, seq_lens, query_start_loc,
                               op="cp::gqa_paged_attention")
    reference.write_cache(k_cache, k, slot_mapping)
    reference.write_cache(v_cache, v, slot_mapping)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q.shape[0])  # [T], 0 for padding
    out, _ = attend(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)
    return out  # fresh tensor (built with torch.zeros inside), never an alias of q


def _gqa_paged_attention_cpu(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start_loc,
                             scale):
    return _gqa_step(cpu_attention.paged_attention_lse, q, k, v, k_cache, v_cache, slot_mapping, block_table,
                     seq_lens, query_start_loc, scale)


@gqa_paged_attention.register_fake
def _gqa_paged_attention_fake(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens,
                              query_start_loc, scale):
    # Dv comes from the value tensor: GQA may use a different value head dim.
    return q.new_empty(q.shape[0], q.shape[1], v.shape[-1])


# --------------------------------------------------------------------------- MLA


def _write_latent(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                  slot_mapping: torch.Tensor) -> None:
    """kv_cache[slot] = [kv_c | k_pe] (the MLA cache stores one [L+R] vector per token)."""
    reference.write_cache(kv_cache, torch.cat([kv_c, k_pe], dim=-1), slot_mapping)


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


def _mla_step(attend, q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, query_start_loc,
              scale):
    """Check, write the latent cache, attend causally with `attend` (the reference, or the CPU kernel)."""
    reference.check_paged_step((kv_cache,), slot_mapping, block_table, seq_lens, query_start_loc,
                               op="cp::mla_attention")
    _write_latent(kv_cache, kv_c, k_pe, slot_mapping)
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, q_nope.shape[0])
    return attend(q_nope, q_pe, kv_cache, block_table, query_start_loc, kv_lens, scale)[0]


def _mla_attention_cpu(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens, query_start_loc,
                       scale):
    return _mla_step(cpu_attention.mla_attention_lse, q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping,
                     block_table, seq_lens, query_start_loc, scale)


@mla_attention.register_fake
def _mla_attention_fake(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                        query_start_loc, scale):
    return torch.empty_like(q_nope, memory_format=torch.contiguous_format)


# --------------------------------------------------------------------------- DSA indexer


@torch.library.custom_op("cp::lightning_indexer", mutates_args=("index_cache",))
def lightning_indexer(
    q_i: torch.Tensor,  # [T, Hi, Di]
    k_i: torch.Tensor,  # [T, Di]  new indexer keys of this step
    w: torch.Tensor,  # [T, Hi]  per-head weights (scales folded in)
    index_cache: torch.Tensor,  # [NB, BS, Di] written in place
    slot_mapping: torch.Tensor,  # [T] int64
    block_table: torch.Tensor,  # [B, nb] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    topk: int,
) -> torch.Tensor:
    """DeepSeek-V3.2 lightning indexer -> int32 [T, topk] request-local positions.

    Score I[t, s] = sum_j w[t, j] * relu(q_i[t, j] . k_i[s]) over the request's cached
    keys s = 0..pos (causal). Sorted by descending score, ties to the lower position;
    -1 padded when fewer than topk keys exist; padding tokens are all -1.
    """
    reference.check_paged_step((index_cache,), slot_mapping, block_table, seq_lens, query_start_loc,
                               op="cp::lightning_indexer")
    reference.write_cache(index_cache, k_i, slot_mapping)
    T = q_i.shape[0]
    kv_lens = layout.causal_lens(query_start_loc, seq_lens, T)
    return reference.lightning_indexer_topk(q_i, index_cache, w, block_table, query_start_loc, kv_lens, topk)


@lightning_indexer.register_fake
def _lightning_indexer_fake(q_i, k_i, w, index_cache, slot_mapping, block_table, seq_lens,
                            query_start_loc, topk):
    return torch.empty((q_i.shape[0], topk), dtype=torch.int32, device=q_i.device)


# --------------------------------------------------------------------------- sparse MLA (SFA)


@torch.library.custom_op("cp::sparse_mla_attention", mutates_args=("kv_cache",))
def sparse_mla_attention(
    q_nope: torch.Tensor,  # [T, H, L]  absorbed
    q_pe: torch.Tensor,  # [T, H, R]
    kv_c: torch.Tensor,  # [T, L]
    k_pe: torch.Tensor,  # [T, R]
    kv_cache: torch.Tensor,  # [NB, BS, L+R] written in place
    slot_mapping: torch.Tensor,  # [T] int64
    block_table: torch.Tensor,  # [B, nb] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    topk_indices: torch.Tensor,  # [T, K] int32 request-local positions, -1 = skip
    scale: float,
) -> torch.Tensor:
    """Sparse (DSA) absorbed MLA: each query attends only its topk_indices -> [T, H, L].

    The cache is written like `mla_attention`. Indices are trusted (no causal crop):
    the indexer already restricted them to 0..pos, and under SFA DCP they are local
    coordinates where a causal bound would not line up.
    """
    reference.check_paged_step((kv_cache,), slot_mapping, block_table, seq_lens, query_start_loc,
                               op="cp::sparse_mla_attention")
    _write_latent(kv_cache, kv_c, k_pe, slot_mapping)
    L = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, L+R]
    out, _ = reference.sparse_attention_with_lse(q, kv_cache, block_table, query_start_loc, topk_indices, L, scale)
    return out


@sparse_mla_attention.register_fake
def _sparse_mla_attention_fake(q_nope, q_pe, kv_c, k_pe, kv_cache, slot_mapping, block_table, seq_lens,
                               query_start_loc, topk_indices, scale):
    return torch.empty_like(q_nope, memory_format=torch.contiguous_format)


# Every op above assumes the single-device cache layout. Under DCP or PCP the caches
# are laid out differently (sharded latents and K/V; the indexer's replicated cache
# only under the SFA DCP pass that allocates and reads it), so a pass must replace or
# claim each of these nodes; the pipeline's final check
# (passes/unsharded_attention.py) refuses a graph that still holds one. A new
# single-device attention op goes in this list.
SINGLE_DEVICE_ATTENTION_OPS: tuple[torch._ops.OpOverloadPacket, ...] = (
    torch.ops.cp.gqa_paged_attention,
    torch.ops.cp.mla_attention,
    torch.ops.cp.sparse_mla_attention,
    torch.ops.cp.lightning_indexer,
)


# ----------------------------------------------------------------------------- declarations (ops/spec.py)
# Every piece of every op above: kernels per device, GE converter, profile bucket.
OPS = (
    OpDecl(gqa_paged_attention, cuda=launch.gqa_paged_attention, npu=TRITON_ASCEND,
           ge=GE("attention", "ScatterNdUpdate", "FusedInferAttentionScore"), profile="attention",
           cpu=_gqa_paged_attention_cpu),
    OpDecl(mla_attention, cuda=launch.mla_attention, npu=TRITON_ASCEND,
           ge=GE("attention", "ScatterNdUpdate", "FusedInferAttentionScore"), profile="attention",
           cpu=_mla_attention_cpu),
    OpDecl(lightning_indexer, cuda=launch.lazy("lightning_indexer_device"), npu=TRITON_ASCEND,
           ge=GE("sparse", "ScatterNdUpdate", "LightningIndexer"), profile="attention"),
    OpDecl(sparse_mla_attention, cuda=launch.lazy("sparse_mla_attention_device"), npu=TRITON_ASCEND,
           ge=GE("sparse", "ScatterNdUpdate", "SparseFlashAttention"), profile="attention"),
)
