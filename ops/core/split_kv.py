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


def kv_splits(n_items: int, max_keys: int, cores: int, *, waves: int = _SPLIT_WAVES,
              min_len: int = _SPLIT_ALIGN) -> tuple[int, int]:
    """(n_splits, split_len) of a split-KV decode launch, from sizes only (capture-safe).

    n_items: work items before splitting (e.g. token x kv head x head block); max_keys:
    the keys an item can have (a block table's width x the page size, or an index
    list's width: device values such as kv_lens are not read); cores: the device's SMs
    / cores. The split count is the one that makes n_items x n_splits fill `waves` waves
    of the cores, its length rounded down to _SPLIT_ALIGN keys and the count recomputed
    from it (n_splits >= the count wanted, so >= `waves` waves; no split is empty at a
    full table), unless splits of `min_len` keys are still too few (short tables: one
    split per `min_len` chunk). A request shorter than max_keys leaves its last splits
    empty. Already `waves` waves of items, or a table of one `min_len` chunk: (1,
    max_keys). Split lengths need not be whole key tiles or pages (the kernels mask each
    split's last tile at its end).

    min_len: the shortest split worth a program (a multiple of _SPLIT_ALIGN, the
    default): a kernel that loads a large per-item operand (the lightning indexer's
    [64, 128] query, 16 KB, the bytes of 63 keys) raises it so that load does not
    outweigh the split's keys.
    """
    if min_len < _SPLIT_ALIGN or min_len % _SPLIT_ALIGN:
        raise ValueError(f"min_len={min_len} must be a positive multiple of {_SPLIT_ALIGN}")
    want = min(_cdiv(waves * cores, max(n_items, 1)), _cdiv(max(max_keys, 1), min_len))
    if want <= 1:
        return 1, max(max_keys, 1)
    split_len = max(min_len, max_keys // want // _SPLIT_ALIGN * _SPLIT_ALIGN)
    return _cdiv(max_keys, split_len), split_len


__all__ = ["kv_splits"]
