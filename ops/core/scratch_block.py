"""The scratch block of a paged cache: where GE graphs write the tokens that write nothing (issue 21).

A token whose cache slot is -1 (padding, or owned by another DCP rank) writes nothing
in eager mode, the Triton kernels and the references: they skip it. A GE graph
(torchair max-autotune) cannot skip a row of one ScatterNdUpdate without a
data-dependent shape, and CANN's aclnnScatterNdUpdate page says out-of-range indices
are unsupported ("indices中的索引数据不支持越界"), so block -1 is not an option there.
The GE converters (`ops/paged/ge_cache.py`) therefore write those rows into the cache's
LAST block, the scratch block: `allocate_kv_cache(..., scratch_block=True)` allocates
`num_blocks + 1` pages and marks the storage here; the allocator
(`BlockAllocator(num_blocks)`) never hands out block `num_blocks`, and the step
check (`metadata._cache_geometry`) refuses a block table naming it, so no attention
reads it. What it holds is undefined (several rows may land on one slot).

Keyed by the storage's C++ object with a weak reference, as `sharded_cache` (views
keep the mark; a clone is new memory and has no scratch block).
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef

_SCRATCH: dict[int, StorageWeakRef] = {}  # storage cdata -> weak ref


def mark_scratch_block(t: torch.Tensor) -> None:
    """Record that `t`'s last block (`t[-1]`) is the scratch block, not a cache page."""
    for key in [k for k, ref in _SCRATCH.items() if ref.expired()]:
        del _SCRATCH[key]
    ref = StorageWeakRef(t.untyped_storage())
    _SCRATCH[ref.cdata] = ref


def has_scratch_block(t: torch.Tensor) -> bool:
    """Whether `t` (or the cache it is a view of) ends with a scratch block."""
    if not _SCRATCH or t.device.type == "meta":
        return False
    ref = _SCRATCH.get(t.untyped_storage()._cdata)
    return ref is not None and not ref.expired()


def usable_blocks(t: torch.Tensor) -> int:
    """Pages a block table may name: `t.shape[0]`, less the scratch block if `t` has one."""
    return int(t.shape[0]) - int(has_scratch_block(t))
