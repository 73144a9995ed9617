"""The rewrite passes, in pipeline order (every pass of `pipeline.PIPELINE` but the final check).

A list of its own because the final check (`unsharded_attention`) names, in its
error, the rewrite passes that would handle a leftover op: it reads this list, and
`PIPELINE` is this list plus that check.
"""

from __future__ import annotations

from cp_compile.passes.base import CPPass
from cp_compile.passes.allreduce_fold import AllReduceFoldPass
from cp_compile.passes.dcp_attention import DCPAttentionPass
from cp_compile.passes.dsa_cp import DSACPPass
from cp_compile.passes.mla_preprocess import MLAPreprocessCacheWritePass, MLAPreprocessPass
from cp_compile.passes.o_proj_dsa_cp import OProjDSACPPass
from cp_compile.passes.pcp_attention import PCPAttentionPass
from cp_compile.passes.project_before_merge import ProjectBeforeMergePass
from cp_compile.passes.sfa_dcp import SFADCPPass

REWRITES: tuple[type[CPPass], ...] = (
    MLAPreprocessPass,  # on the single-device graph: every later pass reads the op's outputs (MLAPO)
    PCPAttentionPass,  # first: it token-shards the prefill graph every later pass sees
    DCPAttentionPass,
    SFADCPPass,
    AllReduceFoldPass,  # after the DCP passes: it folds the merges they marked into the TP all-reduce
    ProjectBeforeMergePass,  # after the DCP passes and the fold (a folded MLA merge is projected by the fold)
    DSACPPass,
    OProjDSACPPass,  # after the attention passes: it rewrites what reads their output
    MLAPreprocessCacheWritePass,  # after the attention passes: folds the latent write they placed
)
