"""Reference access to a paged cache, shared by the op families that read or write one
(paged attention, sparse attention, MLA pre-processing): the torch CPU path and the
tests' oracle.

Conventions (docs/architecture.md §4): tokens are flattened, `query_start_loc[B+1]`,
`seq_lens[B]`, `block_table[B, nb]` (block ids; only entries covering a request's
length are read), `slot_mapping[T]` (-1 = skip). A paged cache is
`[num_blocks, block_size, ...]`; request-local position j of request b lives at page
`block_table[b, j // block_size]`, offset `j % block_size`.
"""

from __future__ import annotations

import torch

from cp_compile.base.errors import MetadataError
from cp_compile.ops.core import kv_quant
from cp_compile.ops.core.sharded_cache import SINGLE_DEVICE_OP_RUNS, refuse_sharded


def check_paged_step(caches: tuple[torch.Tensor, ...], slot_mapping: torch.Tensor, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, query_start_loc: torch.Tensor, op: str = "") -> None:
    """Refuse, before a single-device op writes anything, metadata that would make it
    fail half-way (one cache written, the next not; or written, then an IndexError
    while reading) or write the wrong slot. Cheap: dtypes, shapes and three ranges,
    one host sync. The full semantic check (slots match positions, seq_lens cover the
    new tokens, ...) is `cp_compile.runtime.metadata_checks.validate_metadata`, run once per step
    by the runtime and model entry points. A DCP / PCP-sharded cache is refused
    first (`sharded_cache`; `op` names the op in the message)."""
    refuse_sharded(((f"the cache of {op or 'a single-device attention op'}", c) for c in caches),
                   SINGLE_DEVICE_OP_RUNS)
    for name, t in (("slot_mapping", slot_mapping), ("block_table", block_table), ("seq_lens", seq_lens),
                    ("query_start_loc", query_start_loc)):
        if t.dtype not in (torch.int32, torch.int64):
            raise MetadataError(name, f"dtype {t.dtype} is not an integer index dtype",
                                f"build {name} as torch.int32 or torch.int64 (floats lose slots past 2**24)",
                                value=t.dtype)
    nb_cache, bs = caches[0].shape[0], caches[0].shape[1]
    B = seq_lens.shape[0]
    if block_table.dim() != 2 or block_table.shape[0] != B or query_start_loc.shape[0] != B + 1:
        raise MetadataError("block_table", f"shape {tuple(block_table.shape)} with query_start_loc "
                            f"{tuple(query_start_loc.shape)} does not fit seq_lens [B = {B}]",
                            "pass block_table [B, nb], query_start_loc [B+1], seq_lens [B]",
                            value=tuple(block_table.shape))
    width = block_table.shape[1]
    seq = seq_lens.long()
    need = (seq.clamp(min=0) + bs - 1) // bs  # [B] blocks read per request
    used = torch.arange(width, device=block_table.device)[None, :] < need[:, None]
    bt = block_table.long()
    bad_block = used & ((bt < 0) | (bt >= nb_cache))
    slots = slot_mapping.long()
    bad_slot = (slots < -1) | (slots >= nb_cache * bs)
    flags = torch.stack([(need > width).any(), bad_block.any(), bad_slot.any()]).tolist()
    if flags[0]:
        b = int(torch.nonzero(need > width)[0, 0])
        raise MetadataError("block_table", f"has {width} columns but seq_lens = {int(seq[b])} needs {int(need[b])} "
                            f"blocks of {bs} tokens", "widen the block table (max_blocks_per_req) or shorten the "
                            "request", request=b, value=width)
    if flags[1]:
        b, j = divmod(int(torch.nonzero(bad_block.flatten())[0, 0]), width)
        raise MetadataError("block_table", f"block_table[{b}, {j}] = {int(bt[b, j])} is outside the cache's blocks "
                            f"[0, {nb_cache})", "use block ids from a BlockAllocator sized to this cache",
                            request=b, value=int(bt[b, j]))
    if flags[2]:
        i = int(torch.nonzero(bad_slot)[0, 0])
        raise MetadataError("slot_mapping", f"slot_mapping[{i}] = {int(slots[i])} is outside the cache's slots "
                            f"[0, {nb_cache * bs}) and is not -1 (padding)",
                            "slots are block_id * block_size + offset for block ids of this cache; -1 skips",
                            value=int(slots[i]))


def write_cache(cache: torch.Tensor, new: torch.Tensor, slot_mapping: torch.Tensor,
                scale_cache: torch.Tensor | None = None, static_scale: torch.Tensor | None = None) -> None:
    """cache[slot] = new[t] for every token with slot >= 0 (in place). A quantised cache
    (int8 / fp8, issue 39) stores quantize(new[t]) and its per-row scales in `scale_cache`
    (with a checkpoint's `static_scale`, that scale for every row; decision 71)."""
    kv_quant.check_pair(cache, scale_cache, "the cache")
    if static_scale is not None and scale_cache is None:
        raise ValueError("a static KV scale was passed for a cache in the model's dtype; static scales are for "
                         "int8 / float8_e4m3fn caches only: drop it or allocate a quantised cache")
    kv_quant.check_static_scale(static_scale, "the static KV scale")
    if scale_cache is not None:
        kv_quant.write_quantized(cache, scale_cache, new, slot_mapping, static_scale)
        return
    flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, ...]
    keep = slot_mapping >= 0
    idx = slot_mapping[keep].long()
    flat.index_copy_(0, idx, new[: slot_mapping.shape[0]][keep].to(cache.dtype))


def gather_request_pages(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """Positions 0..length-1 of one request from a paged cache -> [length, ...]."""
    bs = cache.shape[1]
    nb = (length + bs - 1) // bs
    pages = cache[block_table_row[:nb].long()]  # [nb, bs, ...]
    return pages.reshape(nb * bs, *cache.shape[2:])[:length]


def gather_request_rows(cache: torch.Tensor, scale_cache: torch.Tensor | None, block_table_row: torch.Tensor,
                        length: int) -> torch.Tensor:
    """`gather_request_pages` in fp32, dequantised with the rows' scales when `scale_cache` is given."""
    rows = gather_request_pages(cache, block_table_row, length)
    if scale_cache is None:
        return rows.float()
    return kv_quant.dequantize(rows, gather_request_pages(kv_quant.scale_view(cache, scale_cache), block_table_row,
                                                          length))


def write_latent(kv_cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                 slot_mapping: torch.Tensor, scale_cache: torch.Tensor | None = None,
                 static_scale: torch.Tensor | None = None) -> None:
    """kv_cache[slot] = [kv_c | k_pe] (the MLA cache stores one [L+R] vector per token;
    quantised: one scale per token over both parts)."""
    write_cache(kv_cache, torch.cat([kv_c, k_pe], dim=-1), slot_mapping, scale_cache, static_scale)
