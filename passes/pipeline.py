"""The ordered pass registry: which passes exist and the order they run in.

Each pass sees the output of the previous one; `PassManager.for_context` keeps the
ones whose `is_enabled(ctx)` holds. A new pass goes into `PIPELINE` at the place
its inputs exist (docs/architecture.md, "Adding a pass").

  1. dcp_attention              (dcp > 1) GQA / MLA attention -> DCP building blocks
  2. sfa_dcp                    (dcp > 1, pcp = 1, sfa) sparse MLA -> DCP blocks; indexer kept (replicated)
  3. unsharded_attention_check  (dcp > 1 or pcp > 1) no single-device attention op survives
"""

from __future__ import annotations

from cp_compile.passes.base import CPPass
from cp_compile.passes.dcp_attention import DCPAttentionPass
from cp_compile.passes.sfa_dcp import SFADCPPass
from cp_compile.passes.unsharded_attention import UnshardedAttentionCheck

PIPELINE: tuple[type[CPPass], ...] = (
    DCPAttentionPass,
    SFADCPPass,
    UnshardedAttentionCheck,  # always last: it checks what every other pass left
)
