"""The rewrite passes, in pipeline order (passes 0-4 of `pipeline.PIPELINE`).

A list of its own because the final check (`unsharded_attention`) names, in its
error, the rewrite passes that would handle a leftover op: it reads this list, and
`PIPELINE` is this list plus that check.
"""

from __future__ import annotations

from cp_compile.passes.base import CPPass
from cp_compile.passes.dcp_attention import DCPAttentionPass
from cp_compile.passes.dsa_cp import DSACPPass
from cp_compile.passes.o_proj_dsa_cp import OProjDSACPPass
from cp_compile.passes.pcp_attention import PCPAttentionPass
from cp_compile.passes.sfa_dcp import SFADCPPass

REWRITES: tuple[type[CPPass], ...] = (
    PCPAttentionPass,  # first: it token-shards the prefill graph every later pass sees
    DCPAttentionPass,
    SFADCPPass,
    DSACPPass,
    OProjDSACPPass,  # after the attention passes: it rewrites what reads their output
)
