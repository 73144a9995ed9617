"""SFA DCP pass (replicated indexer): sparse MLA attention -> DCP building blocks.

DeepSeek-V3.2 / GLM-5 style layers call `cp::lightning_indexer` (top-k positions
from the indexer's own cache) and then `cp::sparse_mla_attention` over those
positions. Under SFA DCP the latent cache is sharded 1/dcp while the indexer cache
is replicated: every rank stores the indexer keys of every token, in virtual blocks
of `block_size * dcp` tokens (what `allocate_kv_cache` allocates for kind "sfa").

- `cp::lightning_indexer` stays as it is: over the replicated cache with the global
  metadata it computes exactly the single-device top-k on every rank. The pass
  checks that the cache it reads has the replicated layout (the fake value's page
  size) and claims the node for the unsharded-attention check.
- `cp::sparse_mla_attention` becomes `cp_compile.ops.parallel.dcp.dcp_sfa_attention`:
  local latent write, one Q all-gather, global top-k -> this rank's local positions,
  partial sparse attention with LSE, LSE merge. `cp::sparse_mla_attention_quant` (a
  quantised latent, issue 39) becomes the same composition with its scale cache: the
  owner's `cp::quant_cache_write`, the partial dequantising the owner's codes.

Requires dcp == tp (`CPConfig.validate_for` checks it before any pass runs).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from cp_compile.base.config import ConfigError
from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel import dcp as dcp_compose
from cp_compile.passes.dcp_attention import AttentionPattern, DCPAttentionPass
from cp_compile.passes.fx_utils import CLAIMED_KEY, bind_op_args, fake_value, op_nodes


class SparseMLAPattern(AttentionPattern):
    op = torch.ops.cp.sparse_mla_attention
    composition = staticmethod(dcp_compose.dcp_sfa_attention)
    partial = staticmethod(dcp_compose.dcp_sfa_partial)
    fold_partial = staticmethod(dcp_compose.dcp_sfa_partial)  # the all-reduce fold (decision 73)


class SparseMLAQuantPattern(SparseMLAPattern):
    """Sparse MLA over a quantised latent (issue 39): the same composition; the op's
    `kv_scale_cache` is handed to it by name (write on the owner, dequantising partial)."""

    op = torch.ops.cp.sparse_mla_attention_quant


class SFADCPPass(DCPAttentionPass):
    """Rewrite sparse MLA for SFA DCP; keep (and check) the replicated indexer."""

    name = "sfa_dcp"
    patterns = (SparseMLAPattern(), SparseMLAQuantPattern())
    replicates_queries = False  # the composition takes replicated queries; the pass is not built / tested for it
    handles = (torch.ops.cp.sparse_mla_attention, torch.ops.cp.sparse_mla_attention_quant,
               torch.ops.cp.lightning_indexer)
    enabled_when = ("decode_context_parallel_size > 1, prefill_context_parallel_size == 1 and an "
                    "attention kind of 'sfa' (a model with a lightning indexer)")

    @classmethod
    def is_enabled(cls, ctx: CompileContext) -> bool:
        spec = ctx.attention
        return ctx.dcp.size > 1 and ctx.pcp.size == 1 and spec is not None and spec.kind == "sfa"

    def prepare(self, gm: fx.GraphModule) -> None:
        vbs = self.cp.block_size * self.cp.group.size  # tokens per replicated page
        for node in op_nodes(gm, (torch.ops.cp.lightning_indexer,)):
            args = bind_op_args(torch.ops.cp.lightning_indexer, node)
            cache = fake_value(args["index_cache"])
            if cache is None or cache.shape[1] != vbs:
                page = None if cache is None else int(cache.shape[1])
                raise ConfigError(
                    "the indexer cache is replicated under SFA DCP",
                    f"{node.name} reads an index cache with pages of {page} tokens; SFA DCP needs "
                    f"block_size * decode_context_parallel_size = {vbs}",
                    "allocate the caches with cp_compile.allocate_kv_cache(cfg, spec) for kind 'sfa' "
                    "(its `replicated` list holds the indexer caches) and pass those to the indexer")
            node.meta[CLAIMED_KEY] = self.name
