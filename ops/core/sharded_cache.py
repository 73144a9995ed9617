"""Which cache storages hold one rank's DCP / PCP shard (issue 19).

A single-device attention op reads and writes global slots; over this rank's 1/N
shard of a context-parallel cache it silently attends the wrong tokens.
`allocate_kv_cache` marks the storage of every sharded cache tensor here, and every
single-device attention op (`reference.check_paged_step`, which each runs before
writing) refuses a marked cache, so no entry point can bypass the rule: an
uncompiled model that never calls `validate_step`, a view or slice of a cache (it
shares the storage; a tag on the tensor object would be lost), a foreign backend's
graph that calls the op on the cache buffer. Keyed by the storage's C++ object with a
weak reference: a freed cache's entry expires and its address can be reused.
A copy (`clone`) is new memory and is not marked: that is a plain cache.
Cost per op: one dict lookup (none while no sharded cache exists); no device sync.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from cp_compile.base.errors import ConfigError

# What runs when an op itself refuses (the message's "but ..." part).
SINGLE_DEVICE_OP_RUNS = ("the single-device op runs over it as written (an uncompiled model, or a backend other "
                         "than cp_ascend)")
_SHARDED: dict[int, tuple[StorageWeakRef, int]] = {}  # storage cdata -> (weak ref, pcp * dcp)


def mark_sharded(t: torch.Tensor, shards: int) -> None:
    """Record that `t`'s storage is this rank's 1/`shards` shard of a cache."""
    for key in [k for k, (ref, _) in _SHARDED.items() if ref.expired()]:
        del _SHARDED[key]
    ref = StorageWeakRef(t.untyped_storage())
    _SHARDED[ref.cdata] = (ref, shards)


def context_shards(t: torch.Tensor) -> int:
    """pcp * dcp of the sharded cache whose storage `t` uses (a view too); 1 if none."""
    if not _SHARDED:
        return 1
    hit = _SHARDED.get(t.untyped_storage()._cdata)
    return 1 if hit is None or hit[0].expired() else hit[1]


def refuse_sharded(caches: Iterable[tuple[str, torch.Tensor]], runs: str) -> None:
    """ConfigError if a (name, tensor) cache is a DCP / PCP shard. `runs`: what runs
    the single-device ops, in words (for the message)."""
    for name, c in caches:
        n = context_shards(c)
        if n > 1:
            raise ConfigError(
                "a single-device attention op never runs over a DCP / PCP-sharded cache",
                f"{name} is this rank's 1/{n} shard (allocate_kv_cache at pcp * dcp = {n}) but {runs}",
                "compile the model with cp_compile.compile_model / @cp_compile.cp_module (the cp_ascend "
                "passes rewrite its attention into DCP / PCP ops), or run it at pcp * dcp = 1")
