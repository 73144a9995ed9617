"""The ordered pass registry: which passes exist and the order they run in.

Each pass sees the output of the previous one; `PassManager.for_context` keeps the
ones whose `is_enabled(ctx)` holds. A new pass goes into `PIPELINE` at the place
its inputs exist (docs/architecture.md, "Adding a pass").

  -  mla_preprocess             (enable_mla_preprocess) each MLA layer's pre-attention subgraph ->
                                cp::mla_preprocess, on the single-device graph (first: later passes read its outputs)
  0. pcp_attention              (pcp > 1, prefill graphs) GQA / MLA attention -> PCP compositions on this
                                rank's tokens; per-token outputs all-gathered back to global order
  1. dcp_attention              (dcp > 1; at pcp > 1 decode graphs, over the pcp * dcp cache ranks)
                                GQA / MLA attention -> DCP building blocks
  2. sfa_dcp                    (dcp > 1, pcp = 1, sfa) sparse MLA -> DCP blocks; indexer kept (replicated)
  -  allreduce_fold             (after dcp_attention / sfa_dcp, dcp_merge_fold != "off") the merges they marked
                                folded into the TP all-reduce after o_proj: LSE all-gather, rescale, o_proj on the
                                group's heads (issue 37, decisions 62, 73)
  -  project_before_merge       (after dcp_attention / sfa_dcp, dcp_project_before_merge != "off") the merges
                                they marked rebuilt on partials projected by the per-head W_UV (issue 37)
  3. dsa_cp                     (enable_dsa_cp, prefill graph, tp > 1, dcp = pcp = 1, sfa) indexer + sparse
                                MLA -> token-sharded rows over TP (a2a); decode graphs keep the TP layout
  4. o_proj_dsa_cp              (enable_dsa_cp, prefill graph, tp > 1, dcp = 1) row-parallel o_proj ->
                                full (gathered) weight on this rank's token shard + output all-gather
  -  mla_preprocess_cache_write (enable_mla_preprocess) the latent write of the op's own output -> into the op
  5. unsharded_attention_check  (dcp > 1 or pcp > 1) no single-device attention op survives
"""

from __future__ import annotations

from cp_compile.passes.base import CPPass
from cp_compile.passes.rewrites import REWRITES
from cp_compile.passes.unsharded_attention import UnshardedAttentionCheck

PIPELINE: tuple[type[CPPass], ...] = (
    *REWRITES,  # in order (passes/rewrites.py)
    UnshardedAttentionCheck,  # always last: it checks what every other pass left
)
