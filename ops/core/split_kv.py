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
              min_split: int = _SPLIT_ALIGN) -> tuple[int, int]:
    """(n_splits, split_len) of a split-KV decode launch, from sizes only (capture-safe).

    n_items: work items before splitting (e.g. token x kv head x head block); max_keys:
    the keys an item can have (a block table's width x the page size, or an index
    list's width: device values such as kv_lens are not read); cores: the device's SMs
    / cores; min_split: the shortest split worth a program (16 keys: one tl.dot K tile).

    `want` is the count that makes n_items x n_splits fill `waves` waves of the cores
    (capped at splits of min_split keys). Of the counts want .. 2 x want, the one whose
    programs finish soonest when each core runs one program at a time is taken: rounds
    (ceil(n_items x n / cores)) x (split length + min_split, a program's fixed cost: its
    query load and partial write, about min_split keys' bytes), ties to the fewer splits.
    A count that leaves the last round of programs mostly empty loses to one that fills
    it (decision 74, issue 36: MLA at 128 heads, batch 8, 32k: 12 splits, 2.91 waves,
    not 10 at 2.42). Lengths are rounded up to _SPLIT_ALIGN keys and the count recomputed
    from them, so no split is empty at a full table (n x len >= max_keys > (n - 1) x len);
    a request shorter than max_keys leaves its last splits empty. Already `waves` waves
    of items, or a table of one min_split chunk: (1, max_keys). Split lengths need not be
    whole key tiles or pages (the kernels mask each split's last tile at its end).
    """
    keys = max(max_keys, 1)
    most = _cdiv(keys, min_split)
    want = min(_cdiv(waves * cores, max(n_items, 1)), most)
    if want <= 1:
        return 1, keys
    best: tuple[int, int, int] | None = None  # (cost, n_splits, split_len)
    for n in range(want, min(2 * want, most) + 1):
        length = _cdiv(_cdiv(keys, n), _SPLIT_ALIGN) * _SPLIT_ALIGN
        n_eff = _cdiv(keys, length)
        cost = _cdiv(n_items * n_eff, cores) * (length + min_split)
        if best is None or cost < best[0]:
            best = (cost, n_eff, length)
    assert best is not None
    return best[1], best[2]


__all__ = ["kv_splits"]
