"""PCP (prefill context parallel) attention compositions (docs/pcp.md).

Each PCP rank holds a head-tail share of the step's new tokens (`ops/core/pcp_layout.py`)
and its TP heads. A composition has the semantics of the single-device op
(`cp::gqa_paged_attention` / `cp::mla_attention`) restricted to this rank's query
tokens: inputs are this rank's tokens' q / k / v (or latents), padded to the common
per-rank count T_loc, the GLOBAL metadata (as on one device, virtual blocks of
block_size * pcp * dcp tokens) and `token_index` [T_loc] (this rank's global token
indices, ascending, -1 padded); the output is [T_loc, H, Dv] for those tokens (zeros
on padding rows).

Steps (all collectives `_c10d_functional` + `wait_tensor` on group names; no
data-dependent Python control flow, so a pass can trace them):
1. all-gather the new K/V (latents) and the token indices over the PCP group, put
   them back in global order;
2. write this rank's shard of them: the cache is sharded over N = pcp * dcp ranks
   with the §5 rule, cp rank = pcp_rank * dcp + dcp_rank (a DCP decode with
   `DCPContext(group=<the cp group>)` reads it in place);
3. new-token part: this rank's queries attend causally to the gathered new tokens
   at their global positions (no collective);
4. context part: queries all-gathered over DCP (heads) and PCP (tokens), every rank
   attends its context shard, merged by LSE over DCP (back to own heads) and then
   over PCP (back to own tokens, a reduce-scatter);
5. LSE-combine the two parts.
On a fresh step (`PCPContext.fresh`: no request has cached context, the host's
`metadata.is_fresh`) the context part is empty (every context length is 0: lse -inf,
out 0), so steps 4 and 5 are skipped: the output is the new-token part (docs/pcp.md §4).

Nothing here reads module-level parallel state; `PCPContext` comes from
`CompileContext.pcp_view()` or is built by an eager caller.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

import cp_compile.ops  # noqa: F401  (registers the cp::* building blocks)
from cp_compile.base.errors import ConfigError
from cp_compile.ops.core import kv_quant, layout, pcp_layout
from cp_compile.ops.parallel.dcp import (DCPContext, all_gather_heads, dense, kv_major_heads, localize, merge_heads,
                                          rank_major_heads)
from cp_compile.base.parallel_layout import Group

_c10d = torch.ops._c10d_functional
_cp = torch.ops.cp


@dataclass(frozen=True)
class PCPContext:
    """Static facts a PCP graph is specialised on: the layout's PCP, DCP and cp groups
    (`Group`s of cp_compile/base/parallel_layout.py, as `Layout` holds them), the config's
    cache knobs and the merge chosen for this graph."""

    pcp: Group
    dcp: Group
    cp: Group  # the cache's pcp * dcp ranks, rank pcp_rank * dcp + dcp_rank (Layout.cp)
    interleave: int
    block_size: int  # per-rank page size; virtual blocks hold block_size * pcp * dcp tokens
    merge: Literal["ag_rs", "a2a", "replicate"] = "ag_rs"
    # A graph for fresh steps only (no request has cached context; batch kind
    # "fresh_prefill"): no context part. Wrong on a step with context: the host picks.
    fresh: bool = False

    def __post_init__(self) -> None:
        want = (pcp_layout.cp_size(pcp=self.pcp.size, dcp=self.dcp.size),
                pcp_layout.cp_rank(pcp_rank=self.pcp.rank, dcp=self.dcp.size, dcp_rank=self.dcp.rank))
        if (self.cp.size, self.cp.rank) != want:
            raise ConfigError("PCPContext.cp is the pcp * dcp group, rank pcp_rank * dcp + dcp_rank",
                              f"cp=Group(size={self.cp.size}, rank={self.cp.rank}), pcp={self.pcp}, dcp={self.dcp}",
                              "pass the Layout's cp group (CompileContext.pcp_view() does)")

    def layout_view(self) -> DCPContext:
        """The cache layout as `localize` sees it: the cp group (N = pcp*dcp, cp rank)."""
        return DCPContext(group=self.cp, interleave=self.interleave, block_size=self.block_size)

    def dcp_group_view(self) -> DCPContext:
        """The DCP group, for the head gather / head merge of the context part."""
        return DCPContext(group=self.dcp, interleave=self.interleave, block_size=self.block_size, merge=self.merge)


def _gather_tokens(x: Tensor, ctx: PCPContext) -> Tensor:
    """[T_loc, ...] on each PCP rank -> [pcp*T_loc, ...], rank-major (group rank order)."""
    g = _c10d.all_gather_into_tensor.default(dense(x), ctx.pcp.size, ctx.pcp.name)
    return _c10d.wait_tensor.default(g)


class _Step:
    """Per-forward PCP metadata shared by every layer (computed once, like `localize`)."""

    def __init__(self, ctx: PCPContext, token_index: Tensor, slot_mapping: Tensor, query_start_loc: Tensor,
                 seq_lens: Tensor) -> None:
        T = slot_mapping.shape[0]
        self.token_index = token_index.long()  # [T_loc], -1 padded
        self.valid = self.token_index >= 0  # [T_loc]
        self.gathered_index = _gather_tokens(self.token_index, ctx)  # [pcp*T_loc]
        self.inv = pcp_layout.restore_order(self.gathered_index, T)  # [T]: global token -> gather row
        self.local = localize(ctx.layout_view(), slot_mapping, query_start_loc, seq_lens)
        mine = self.token_index.clamp(min=0)
        # New-token part: this rank's queries grouped by request (they are in global order).
        self.local_qsl = pcp_layout.pcp_local_query_start_loc(self.token_index, query_start_loc)  # [B+1]
        qsl = query_start_loc.long()
        req = layout.request_index(query_start_loc, T).long().clamp(min=0)[mine]  # [T_loc]
        self.new_lens = torch.where(self.valid, self.token_index - qsl[req] + 1,
                                    torch.zeros_like(self.token_index)).to(torch.int32)  # [T_loc]
        # The gathered new tokens as a paged "cache" of block size 1, in global order:
        # request b's new token j is row qsl[b] + j. Width T keeps the shape static.
        cols = torch.arange(T, device=slot_mapping.device, dtype=torch.int64)  # [T]
        # Clamped by a tensor (cols[-1] = T-1), not a Python number: under a graph pass
        # T is a traced size, which must not be baked in as a constant.
        self.new_table = torch.minimum(qsl[:-1, None] + cols[None, :], cols[-1]).to(torch.int32)  # [B, T]
        # Real global tokens (not batch padding): the rows an output restore keeps.
        self.real = cols < qsl[-1]  # [T]


def _context_part(part_out: Tensor, part_lse: Tensor, step: _Step, ctx: PCPContext, heads: int,
                  dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Context partials of every global token over all gathered heads -> this rank's
    tokens and heads, merged over the pcp*dcp shards. ([T, dcp*H, Dv], [T, dcp*H]) ->
    ([T_loc, H, Dv] `dtype`, [T_loc, H] fp32)."""
    if ctx.dcp.size > 1:
        out, lse = merge_heads(part_out, part_lse, ctx.dcp_group_view(), heads, dtype)  # [T, H, ...]
    else:
        out, lse = part_out, part_lse
    # PCP merge on tokens: all-gather the LSEs, weight this rank's partial, then a
    # reduce-scatter over rows in rank-major token order hands each rank its tokens.
    lse_all = _c10d.wait_tensor.default(_c10d.all_gather_into_tensor.default(
        dense(lse.transpose(0, 1)), ctx.pcp.size, ctx.pcp.name))  # [pcp*H, T]
    rescaled = _cp.lse_rescale.default(out, lse, lse_all)
    scaled, total = rescaled[0], rescaled[1]  # [T, H, Dv] fp32, [T, H] fp32
    rows = step.gathered_index.clamp(min=0)
    keep = (step.gathered_index >= 0)[:, None, None]
    send = torch.where(keep, scaled[rows], 0.0)  # [pcp*T_loc, H, Dv]
    mine = _c10d.wait_tensor.default(_c10d.reduce_scatter_tensor.default(
        dense(send.to(dtype)), "sum", ctx.pcp.size, ctx.pcp.name))  # [T_loc, H, Dv]
    return mine, total[step.token_index.clamp(min=0)]


def _finish(out: Tensor, step: _Step, dtype: torch.dtype) -> Tensor:
    """[T_loc, H, Dv] -> the same in `dtype`, zeros on padding rows (token index -1)."""
    return torch.where(step.valid[:, None, None], out, 0.0).to(dtype)


def _combine(ctx_out: Tensor, ctx_lse: Tensor, new_out: Tensor, new_lse: Tensor, step: _Step,
             dtype: torch.dtype) -> Tensor:
    merged = _cp.lse_combine.default(torch.stack([ctx_out, new_out]), torch.stack([ctx_lse, new_lse]))[0]
    return _finish(merged, step, dtype)


def pcp_step(ctx: PCPContext, token_index: Tensor, slot_mapping: Tensor, query_start_loc: Tensor,
             seq_lens: Tensor) -> _Step:
    """Once per forward: the PCP metadata every layer of this rank shares (one small
    all-gather of the token indices)."""
    return _Step(ctx, token_index, slot_mapping, query_start_loc, seq_lens)


def pcp_restore_tokens(x: Tensor, step: _Step, ctx: PCPContext) -> Tensor:
    """This rank's token rows of a per-token tensor -> every global token, on every
    PCP rank: x [T_loc, ...] (rows in `step.token_index` order) -> [T, ...] in global
    order, zeros on batch-padding tokens (no rank computes them).

    One all-gather over PCP (rank-major), then the rows are put back in global order
    with the indices `pcp_step` gathered once. The graph pass applies it to the
    outputs of a token-sharded prefill graph (e.g. the logits).
    """
    glob = _gather_tokens(x, ctx)[step.inv]  # [T, ...]
    flat = glob.unsqueeze(-1).flatten(1)  # [T, prod(...)]: no rank read off a traced value
    return torch.where(step.real[:, None], flat, 0).view_as(glob)


def _quantized_new_tokens(new: Tensor, cache: Tensor, scale_cache: Tensor, step: _Step) -> tuple[Tensor, Tensor]:
    """The gathered new tokens [T, rows..., D] (model dtype, global order) as a quantised
    paged "cache" of block size 1: ([T, 1, rows..., D] codes in the cache's dtype,
    [T, 1, rows] fp32 scales), written by the op that writes the owner's cache
    (`cp::quant_cache_write`), so the new-token part reads every new token's K / V exactly
    as the single device reads it back from its cache: the codes and scale its owner
    stores (issue 39, decision 68)."""
    T = new.shape[0]
    rows = 1
    for d in new.shape[1:-1]:  # the KV heads (GQA) or nothing (MLA); plain ints, also under a graph pass
        rows *= d
    codes = torch.zeros((T, 1, *new.shape[1:]), dtype=cache.dtype, device=new.device)
    scales = torch.zeros((T, 1, rows), dtype=scale_cache.dtype, device=new.device)
    slots = torch.arange(T, device=new.device, dtype=torch.int64).to(step.local.slot_mapping.dtype)
    _cp.quant_cache_write.default(new, codes, scales, slots)
    return codes, scales


def _check_scales(cache: Tensor, scale_cache: Tensor | None, what: str) -> bool:
    """Whether the composition runs over a quantised cache (a scale cache passed); a quantised
    cache without its scales, or scales beside a model-dtype cache, refused by name."""
    # Only the dtype here (shapes may be traced sizes under a graph pass): the ops check the pairing.
    if scale_cache is None and kv_quant.is_quantized(cache.dtype):
        raise ValueError(f"{what} is {cache.dtype} (a quantised KV cache) but no scale cache was passed; pass the "
                         "layer's scale cache (allocate_kv_cache with CPConfig(kv_cache_dtype=...) makes it)")
    return scale_cache is not None


def _refuse_static(*static_scales: Tensor | None) -> None:
    """A checkpoint's static KV scales (decision 71) are not built into the PCP prefill."""
    if any(s is not None for s in static_scales):
        raise NotImplementedError("the PCP prefill does not take a checkpoint's static KV scales (k_scale / v_scale) "
                                  "yet (decision 71). Fix: prefill_context_parallel_size=1, or serve without the "
                                  "checkpoint's scales (dynamic per-token scales)")


def pcp_gqa_attention(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                      block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor, token_index: Tensor,
                      scale: float, ctx: PCPContext, step: _Step | None = None,
                      k_scale_cache: Tensor | None = None, v_scale_cache: Tensor | None = None,
                      k_static_scale: Tensor | None = None, v_static_scale: Tensor | None = None) -> Tensor:
    """PCP version of `cp::gqa_paged_attention` for this rank's tokens.

    q [T_loc, Hq, D], k [T_loc, Hkv, D], v [T_loc, Hkv, Dv] (this rank's tokens and
    heads), caches [NB, BS, Hkv, *] (this rank's shard), metadata global ->
    out [T_loc, Hq, Dv]. Exact for prefill, chunked prefill with a cached prefix and
    mixed batches; at `ctx.fresh` only for steps without cached context.
    """
    _refuse_static(k_static_scale, v_static_scale)
    quant = _check_scales(k_cache, k_scale_cache, "k_cache") | _check_scales(v_cache, v_scale_cache, "v_cache")
    if step is None:
        step = pcp_step(ctx, token_index, slot_mapping, query_start_loc, seq_lens)
    D = k.shape[-1]
    kv = _gather_tokens(torch.cat([k, v], dim=-1), ctx)[step.inv]  # [T, Hkv, D+Dv], global order; one gather
    if quant:  # the owner stores codes + scales; the new-token part reads the same codes + scales
        assert k_scale_cache is not None and v_scale_cache is not None
        k_new, v_new = kv[..., :D], kv[..., D:]
        _cp.quant_cache_write.default(k_new, k_cache, k_scale_cache, step.local.slot_mapping)
        _cp.quant_cache_write.default(v_new, v_cache, v_scale_cache, step.local.slot_mapping)
        kq, ks = _quantized_new_tokens(k_new, k_cache, k_scale_cache, step)
        vq, vs = _quantized_new_tokens(v_new, v_cache, v_scale_cache, step)
        new = _cp.paged_attention_lse.default(q, kq, vq, step.new_table, step.local_qsl, step.new_lens, scale,
                                              ks, vs)
    else:
        k_new, v_new = kv[..., :D].to(k_cache.dtype), kv[..., D:].to(v_cache.dtype)
        _cp.cache_write.default(k_new, k_cache, step.local.slot_mapping)
        _cp.cache_write.default(v_new, v_cache, step.local.slot_mapping)
        # New tokens: the single-device op reads them back from the cache, in its dtype.
        new = _cp.paged_attention_lse.default(q, k_new.unsqueeze(1), v_new.unsqueeze(1), step.new_table,
                                              step.local_qsl, step.new_lens, scale)
    if ctx.fresh:  # no cached context: the new tokens are all the keys (module docstring)
        return _finish(new[0], step, q.dtype)
    # Context: every global query, every DCP-group head, against this rank's shard.
    kv_heads = k.shape[1]
    q_h = all_gather_heads(q, ctx.dcp_group_view()) if ctx.dcp.size > 1 else q  # [T_loc, dcp*Hq, D]
    # Each DCP rank's heads with their own KV head (identity at one KV head per rank).
    q_glob = kv_major_heads(_gather_tokens(q_h, ctx)[step.inv], ctx.dcp.size, kv_heads)  # [T, dcp*Hq, D]
    part = _cp.paged_attention_lse.default(q_glob, k_cache, v_cache, block_table, query_start_loc,
                                           step.local.context_lens, scale, k_scale_cache, v_scale_cache)
    ctx_out, ctx_lse = _context_part(rank_major_heads(part[0], ctx.dcp.size, kv_heads),
                                     rank_major_heads(part[1], ctx.dcp.size, kv_heads), step, ctx, q.shape[1],
                                     q.dtype)
    return _combine(ctx_out, ctx_lse, new[0], new[1], step, q.dtype)


def pcp_mla_attention(q_nope: Tensor, q_pe: Tensor, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor,
                      slot_mapping: Tensor, block_table: Tensor, seq_lens: Tensor, query_start_loc: Tensor,
                      token_index: Tensor, scale: float, ctx: PCPContext, step: _Step | None = None,
                      kv_scale_cache: Tensor | None = None, kv_static_scale: Tensor | None = None) -> Tensor:
    """PCP version of `cp::mla_attention` (absorbed MLA) for this rank's tokens.

    q_nope [T_loc, H, L], q_pe [T_loc, H, R], kv_c [T_loc, L], k_pe [T_loc, R],
    kv_cache [NB, BS, L+R] (this rank's shard) -> latent out [T_loc, H, L].
    """
    _refuse_static(kv_static_scale)
    quant = _check_scales(kv_cache, kv_scale_cache, "kv_cache")
    if step is None:
        step = pcp_step(ctx, token_index, slot_mapping, query_start_loc, seq_lens)
    L = q_nope.shape[-1]
    latent = _gather_tokens(torch.cat([kv_c, k_pe], dim=-1), ctx)[step.inv]  # [T, L+R]
    if quant:  # one scale per token over [c | k_pe], as the owner writes it
        assert kv_scale_cache is not None
        _cp.quant_cache_write.default(latent, kv_cache, kv_scale_cache, step.local.slot_mapping)
        lq, ls = _quantized_new_tokens(latent, kv_cache, kv_scale_cache, step)
        new = _cp.mla_partial_attention.default(q_nope, q_pe, lq, step.new_table, step.local_qsl, step.new_lens,
                                                scale, ls)
    else:
        latent = latent.to(kv_cache.dtype)
        _cp.cache_write.default(latent, kv_cache, step.local.slot_mapping)
        new = _cp.mla_partial_attention.default(q_nope, q_pe, latent.unsqueeze(1), step.new_table, step.local_qsl,
                                                step.new_lens, scale)
    if ctx.fresh:  # no cached context (module docstring)
        return _finish(new[0], step, q_nope.dtype)
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T_loc, H, L+R]: one gather per group
    q_h = all_gather_heads(q, ctx.dcp_group_view()) if ctx.dcp.size > 1 else q  # [T_loc, dcp*H, L+R]
    q_glob = _gather_tokens(q_h, ctx)[step.inv]  # [T, dcp*H, L+R]
    part = _cp.mla_partial_attention.default(q_glob[..., :L], q_glob[..., L:], kv_cache, block_table,
                                             query_start_loc, step.local.context_lens, scale, kv_scale_cache)
    ctx_out, ctx_lse = _context_part(part[0], part[1], step, ctx, q_nope.shape[1], q_nope.dtype)
    return _combine(ctx_out, ctx_lse, new[0], new[1], step, q_nope.dtype)
