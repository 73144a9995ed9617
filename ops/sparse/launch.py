"""The accelerator kernels of the sparse (DSA) ops, with each op's signature (their `OpDecl.cuda`).

The `*_device` functions of `triton_indexer.py` and `triton_sparse_mla.py` already take
the ops' arguments: they are named here through `core/launcher.lazy` (fetched, and
triton imported, on first call; registration imports no triton).
"""

from __future__ import annotations

import torch

from cp_compile.ops.core import layout
from cp_compile.ops.core.launcher import lazy

_INDEXER = "cp_compile.ops.sparse.triton_indexer"
_SPARSE_MLA = "cp_compile.ops.sparse.triton_sparse_mla"

lightning_indexer = lazy(_INDEXER, "lightning_indexer_device")
lightning_indexer_topk_rows = lazy(_INDEXER, "lightning_indexer_topk_rows_device")
sparse_mla_attention = lazy(_SPARSE_MLA, "sparse_mla_attention_device")
sparse_mla_attention_quant = lazy(_SPARSE_MLA, "sparse_mla_attention_quant_device")
sparse_mla_attention_quant_npu = lazy(_SPARSE_MLA, "sparse_mla_attention_quant_npu")
sparse_mla_partial_attention = lazy(_SPARSE_MLA, "sparse_mla_partial_attention_device")
sparse_mla_rows_attention = lazy(_SPARSE_MLA, "sparse_mla_rows_attention_device")


def dcp_sparse_indices(topk_indices: torch.Tensor, cp: int, rank: int, interleave: int,
                       block_size: int) -> torch.Tensor:
    # Vectorised torch (a stable sort, gathers; no host read): runs as it is on the device.
    return layout.global_to_local_indices(topk_indices, cp=cp, rank=rank, interleave=interleave,
                                          block_size=block_size)
