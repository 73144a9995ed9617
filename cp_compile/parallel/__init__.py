"""Parallel compositions: single-device attention semantics built from `cp::*` ops
and functional collectives (docs/architecture.md).

- `dcp`: traceable DCP compositions (the DCP attention pass emits them into graphs;
  eager callers use them directly on an initialised DCP group);
- `dcp_eager`: DCP compositions whose shapes depend on the data (eager only).
"""
