"""DSA-CP compositions: token-sharded indexer and sparse MLA over the TP group (docs/dsa_cp.md).

Under plain TP every rank runs the lightning indexer for all T tokens (replicated
O(T * S) scoring) and sparse attention for its H / tp heads of all T tokens. DSA-CP
shards the *queries* by tokens instead: the step is padded to T_pad = tp * rows and
rank r owns the rows [r * rows, (r + 1) * rows) (`layout.token_shard_rows`).

- Indexer: every rank still writes all T indexer keys into its (full) index cache,
  keys being computed replicated and cheap, but scores only its own rows
  (`cp::lightning_indexer_topk_rows`) -> top-k [rows, K].
- Attention: the model's absorbed queries hold this rank's heads of all tokens
  ([T, H/tp, L+R]); one all-to-all over TP scatters tokens and gathers heads
  -> [rows, H, L+R], sparse MLA runs over the full latent cache for the shard's rows
  with their top-k (`cp::sparse_mla_rows_attention`), and the inverse all-to-all
  (scatter heads, gather tokens) returns [T, H/tp, L] to the model's W_UV and
  row-parallel o_proj. No weight is replicated (vLLM-Ascend replicates q_b_proj /
  kv_b_proj at full heads instead).

The pair `dsa_cp_indexer` + `dsa_cp_sparse_attention` has the semantics of the pair
`cp::lightning_indexer` + `cp::sparse_mla_attention` for this rank's TP heads, for
prefill, mixed, chunked-prefill and decode batches alike. The `dsa_cp` pass
(passes/dsa_cp.py) uses them in prefill graphs only; decode graphs keep the TP head
layout.

Traceable like `parallel/dcp.py`: `cp::*` ops and `_c10d_functional` collectives
(each followed by `wait_tensor`), no data-dependent control flow. The only shape
arithmetic is the shard size ceil(T / tp) and the pad T_pad - T, both functions of
the token count alone (SymInt-friendly under dynamic shapes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

import cp_compile.ops  # noqa: F401  (registers the cp::* building blocks)
from cp_compile.ops.core import layout
from cp_compile.base.parallel_layout import Group

_c10d = torch.ops._c10d_functional
_cp = torch.ops.cp


@dataclass(frozen=True)
class DSACPContext:
    """Static facts a DSA-CP graph is specialised on: the layout's TP group (the token
    shards; `Group(size, rank, name)`, cp_compile/base/parallel_layout.py)."""

    tp: Group


def shard_rows(num_tokens: int, ctx: DSACPContext) -> int:
    """Rows per rank, ceil(T / tp) (`layout.token_shard_rows`; SymInt-safe)."""
    return layout.token_shard_rows(num_tokens, tp=ctx.tp.size)


def pad_tokens(x: Tensor, ctx: DSACPContext) -> Tensor:
    """[T, ...] -> [T_pad, ...] with zero rows appended (T_pad = tp * ceil(T / tp))."""
    T = x.shape[0]
    pad = shard_rows(T, ctx) * ctx.tp.size - T
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))


def local_rows(x: Tensor, ctx: DSACPContext) -> Tensor:
    """This rank's rows of [T, ...]: the padded tensor's rows [rank * rows, (rank + 1) * rows)."""
    rows = shard_rows(x.shape[0], ctx)
    return pad_tokens(x, ctx)[ctx.tp.rank * rows:(ctx.tp.rank + 1) * rows]


def tokens_to_heads(x: Tensor, ctx: DSACPContext) -> Tensor:
    """All-to-all: [T, Hl, D] (my heads, all tokens) -> [rows, tp * Hl, D] (all heads, my rows).

    Chunk j of dim 0 (rank j's rows) goes to rank j; what comes back from rank j is
    rank j's heads of my rows, so heads arrive in TP rank order, the model's layout.
    """
    xp = pad_tokens(x, ctx).contiguous()  # [T_pad, Hl, D]
    rows = xp.shape[0] // ctx.tp.size
    splits = [rows] * ctx.tp.size
    recv = _c10d.all_to_all_single.default(xp, splits, splits, ctx.tp.name)
    recv = _c10d.wait_tensor.default(recv)  # [tp * rows, Hl, D]: chunk j = rank j's heads of my rows
    # Split the token dim into its tp chunks and lay them side by side on the head dim.
    # No view of the symbolic token dim: a view / reshape splitting tp * rows would make
    # the fake tracer guard rows != 1, and the graph recompile for steps with T <= tp.
    return torch.cat(recv.tensor_split(ctx.tp.size, dim=0), dim=1)  # [rows, tp * Hl, D]


def heads_to_tokens(y: Tensor, ctx: DSACPContext, num_tokens: int) -> Tensor:
    """Inverse all-to-all: [rows, tp * Hl, D] (all heads, my rows) -> [T, Hl, D] (my heads, all tokens).

    Head chunk j goes to rank j; what comes back from rank j is my heads of rank j's
    rows, which in rank order are the padded token order; the pad rows are dropped.
    """
    rows, hl = y.shape[0], y.shape[1] // ctx.tp.size
    # Head chunk j first: [tp * rows, Hl, D], concatenated on the token dim (no view of it).
    send = torch.cat(y.split(hl, dim=1), dim=0).contiguous()
    splits = [rows] * ctx.tp.size
    recv = _c10d.all_to_all_single.default(send, splits, splits, ctx.tp.name)
    recv = _c10d.wait_tensor.default(recv)  # [T_pad, Hl, D] in token order
    return recv[:num_tokens]


def dsa_cp_indexer(q_i: Tensor, k_i: Tensor, w: Tensor, index_cache: Tensor, slot_mapping: Tensor,
                   block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, topk: int,
                   ctx: DSACPContext) -> Tensor:
    """DSA-CP version of `cp::lightning_indexer` (same arguments, all T tokens' q_i / k_i / w,
    global metadata) -> top-k of this rank's rows only, int32 [rows, topk].

    The cache write stays global (every rank holds every indexer key, as on one
    device); only the scoring is sharded.
    """
    _cp.cache_write.default(k_i, index_cache, slot_mapping)
    return _cp.lightning_indexer_topk_rows.default(local_rows(q_i, ctx), index_cache, local_rows(w, ctx),
                                                   block_table, seq_lens, query_start_loc, ctx.tp.size, ctx.tp.rank, topk)


def dsa_cp_sparse_attention(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                            slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                            topk_rows: Tensor, scale: float, ctx: DSACPContext,
                            kv_scale_cache: Tensor | None = None) -> Tensor:
    """DSA-CP version of `cp::sparse_mla_attention` for this rank's TP heads -> [T, H/tp, L].

    q_nope [T, H/tp, L], q_pe [T, H/tp, R]: this rank's heads of all tokens (the TP
    model's layout); kv_c [T, L], k_pe [T, R]: every token's new latents (replicated
    in the TP model, so the full cache is written on every rank with no gather);
    topk_rows [rows, K] from `dsa_cp_indexer`. A quantised latent (`kv_scale_cache`
    [NB, BS, 1], issue 39): every rank quantises every token as one device does (the same
    write of the same rows), and the row shard's attention dequantises on load.
    """
    new = torch.cat([kv_c, k_pe], dim=-1)  # [T, L+R]
    if kv_scale_cache is None:
        _cp.cache_write.default(new, kv_cache, slot_mapping)
    else:
        _cp.quant_cache_write.default(new, kv_cache, kv_scale_cache, slot_mapping)
    L = q_nope.shape[-1]
    q = tokens_to_heads(torch.cat([q_nope, q_pe], dim=-1), ctx)  # [rows, H, L+R]: one a2a for both parts
    # The scale cache only when there is one: the model-dtype call keeps the arguments its GE
    # converter (ops/sparse/ge_dsa_cp.py) takes.
    scales = () if kv_scale_cache is None else (kv_scale_cache,)
    out = _cp.sparse_mla_rows_attention.default(q[..., :L], q[..., L:], kv_cache, block_table, seq_lens,
                                                query_start_loc, topk_rows, ctx.tp.size, ctx.tp.rank, scale,
                                                *scales)  # [rows, H, L]
    return heads_to_tokens(out, ctx, q_nope.shape[0])


def all_gather_topk(topk_rows: Tensor, ctx: DSACPContext, num_tokens: int) -> Tensor:
    """Every rank's top-k rows -> the step's full top-k [T, K] (rank order = token order).

    The indexer-only variant of DSA-CP: shard the scoring, then give every rank the
    single-device top-k so sparse attention keeps the TP head layout
    (`cp::sparse_mla_attention` on this rank's heads of all tokens) with no Q / output
    all-to-all and no change to the o_proj path. It sends K int32 per token instead of
    the all-to-alls' H * (2L + R) activations (docs/dsa_cp.md, "Traffic").
    """
    g = _c10d.all_gather_into_tensor.default(topk_rows.contiguous(), ctx.tp.size, ctx.tp.name)
    return _c10d.wait_tensor.default(g)[:num_tokens]  # [T_pad, K] -> [T, K]
