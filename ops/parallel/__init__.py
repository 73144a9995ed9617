"""Parallel compositions: single-device attention semantics built from `cp::*` ops
and functional collectives (docs/architecture.md §2, §5, §6, §6b). The layer between
the ops (below) and the passes (above): it imports `cp_compile.ops` and torch's
collectives, nothing higher.

- `dcp`: traceable DCP compositions (the DCP attention pass emits them into graphs;
  eager callers use them directly on an initialised DCP group);
- `pcp`: PCP attention compositions (GQA, MLA) for this rank's head-tail tokens;
- `dsa_cp`: DSA-CP token-sharded indexer and sparse attention over the TP group;
- `o_proj`: DSA-CP o_proj on the token shard with the gathered full weight.
"""
