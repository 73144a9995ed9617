"""The split count of a split-KV launch, from shapes and the core count only (decision 54).

Shared by the op families that split a key range across programs (paged decode,
sparse MLA, the lightning indexer); the families may not import each other, so it
lives here. Plain integer arithmetic, no triton and no tensor: nothing is read back
from the device, so a CUDA graph captures the same launch for every step of a shape.
"""

from __future__ import annotations

# Waves of programs a split decode launch aims for on the device's cores: one wave
# leaves the SMs idle while the last programs of a wave finish; two keep them busy
# through the tail (docs/decisions.md 54).
_SPLIT_WAVES = 2
# Split lengths are multiples of this many keys: tl.dot's smallest K tile, so a split of
# a full table never ends in a tile of a few keys.
_SPLIT_ALIGN = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def kv_splits(n_items: int, max_keys: int, cores: int, *, waves: int = _SPLIT_WAVES) -> tuple[int, int]:
    """(n_splits, split_len) of a split-KV decode launch, from sizes only (capture-safe).

    n_items: work items before splitting (e.g. token x kv head x head block); max_keys:
    the keys an item can have (a block table's width x the page size, or an index
    list's width: device values such as kv_lens are not read); cores: the device's SMs
    / cores. The split count is the one that makes n_items x n_splits fill `waves` waves
    of the cores, its length rounded down to _SPLIT_ALIGN keys and the count recomputed
    from it (n_splits >= the count wanted, so >= `waves` waves; no split is empty at a
    full table), unless splits of _SPLIT_ALIGN keys are still too few (short tables: one
    split per aligned chunk). A request shorter than max_keys leaves its last splits
    empty. Already `waves` waves of items, or a table of one aligned chunk: (1,
    max_keys). Split lengths need not be whole key tiles or pages (the kernels mask each
    split's last tile at its end).
    """
    want = min(_cdiv(waves * cores, max(n_items, 1)), _cdiv(max(max_keys, 1), _SPLIT_ALIGN))
    if want <= 1:
        return 1, max(max_keys, 1)
    split_len = max(_SPLIT_ALIGN, max_keys // want // _SPLIT_ALIGN * _SPLIT_ALIGN)
    return _cdiv(max_keys, split_len), split_len


__all__ = ["kv_splits"]
