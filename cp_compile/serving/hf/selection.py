"""Which checkpoint entries a TP-sharded parameter holds.

The TP plan (`tp.py`, `moe.py`) tags each parameter it shards with `(dim, index)`:
the entries of the checkpoint tensor it keeps along `dim` (this rank's heads,
intermediate columns, expert rows). The rank-local loader (`rank_load.py`) reads
exactly those entries from the safetensors files, so the plan is written once and
drives both the in-place sharding of a loaded model and the loading of a meta one.
An untagged parameter is replicated (read whole).
"""

from __future__ import annotations

import torch
from torch import nn

SELECTION_ATTR = "cp_tp_selection"


def select(param: nn.Parameter, dim: int, index: torch.Tensor) -> nn.Parameter:
    """Tag `param` as holding `index` (1-D, on any device) of the checkpoint's `dim`."""
    setattr(param, SELECTION_ATTR, (dim, index.detach().cpu()))
    return param


def selection_of(tensor: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    return getattr(tensor, SELECTION_ATTR, None)
