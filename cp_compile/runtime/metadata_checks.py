"""Validation of one step's global metadata against this rank's caches (docs/architecture.md §4, §7).

`validate_metadata` checks the metadata alone (against a cache geometry);
`validate_step` reads the geometry off this rank's caches first. Both run before any
cache write and read only global data and the cache geometry, identical on every
rank of a DCP group: every rank reaches the same verdict before any collective.
The `cp` arguments are the cache's shard count: the size of its context-parallel
group (pcp * dcp; the DCP group at pcp = 1).
`validate_forward_args` finds the metadata and caches among a forward's arguments
(the compiled entry's check).
"""

from __future__ import annotations

from dataclasses import fields
import warnings
from typing import Any, Mapping, Sequence

import torch

from cp_compile.base.errors import MetadataError
from cp_compile.ops.core.scratch_block import has_scratch_block
from cp_compile.ops.core.sharded_cache import refuse_sharded
from cp_compile.runtime.metadata import AttentionMetadata
from cp_compile.runtime.parallel_state import ParallelState, parallel_state_or_none

__all__ = ["validate_forward_args", "validate_metadata", "validate_step"]

# Dtypes the ops accept for metadata. Documented: query_start_loc / seq_lens /
# block_table int32, slot_mapping / positions int64; either width works everywhere
# (the ops widen before indexing). Floats are refused: a float32 slot is exact only
# up to 2**24.
_INDEX_DTYPES = (torch.int32, torch.int64)


def _first(mask: torch.Tensor) -> int:
    return int(torch.nonzero(mask.flatten())[0, 0])


def validate_metadata(meta: AttentionMetadata, *, num_blocks: int, block_size: int, cp: int = 1,
                      num_tokens: int | None = None) -> None:
    """Every check a step needs before it writes a cache; `MetadataError` on the first failure.

    num_blocks: pages per layer cache (the block-id range); block_size: tokens per
    page on this rank; cp: ranks a block is sharded over, the cache's context-parallel
    group (pcp * dcp; a block id covers block_size * cp tokens);
    num_tokens: the step's token count (input_ids / q rows) when known.

    Checks, in order: field types and dtypes (int32/int64), shapes, a non-empty
    batch; query_start_loc starts at 0, is non-decreasing and ends <= T; seq_lens >=
    each request's new tokens; the block table is wide enough for seq_lens; every
    block a request uses is in [0, num_blocks); each new token's slot is the one its
    position maps to through its request's blocks and padding slots are -1; no two
    tokens write one slot; positions of real tokens match (skipped when
    `meta.positions` is None: a graph that never reads it). Values are checked with
    vectorised ops and one host sync; locating a failure costs more, but only then.
    """
    vbs = block_size * cp
    # -- types, dtypes, shapes: host-side, free.
    for f in fields(AttentionMetadata):
        t = getattr(meta, f.name)
        if t is None and f.name == "positions":
            continue  # a compiled graph that never reads meta.positions (backend step check): not checked
        if not isinstance(t, torch.Tensor):
            raise MetadataError(f.name, f"is a {type(t).__name__}, not a tensor", f"pass {f.name} as a torch tensor",
                                value=type(t).__name__)
        if t.dtype not in _INDEX_DTYPES:
            raise MetadataError(f.name, f"dtype {t.dtype} is not an integer index dtype",
                                f"build {f.name} as torch.int32 or torch.int64 (floats lose slots past 2**24)",
                                value=t.dtype)
    qsl, seq, bt, slots, pos = (meta.query_start_loc, meta.seq_lens, meta.block_table, meta.slot_mapping,
                                meta.positions)
    devices = {t.device for t in (qsl, seq, bt, slots, pos) if t is not None}
    if len(devices) > 1:
        raise MetadataError("metadata", f"fields are on several devices {sorted(map(str, devices))}",
                            "move the whole metadata with meta.to(device)")
    if qsl.dim() != 1 or qsl.shape[0] < 1:
        raise MetadataError("query_start_loc", f"shape {tuple(qsl.shape)} is not [B+1]",
                            "pass the B+1 cumulative token offsets, starting at 0", value=tuple(qsl.shape))
    B = qsl.shape[0] - 1
    if B == 0:
        raise MetadataError("query_start_loc", "the batch is empty (B = 0 requests)",
                            "skip the step when no request has tokens to run", value=0)
    if seq.dim() != 1 or seq.shape[0] != B:
        raise MetadataError("seq_lens", f"shape {tuple(seq.shape)} does not match B = {B} requests "
                            f"(query_start_loc has {B + 1} entries)", "pass one length per request",
                            value=tuple(seq.shape))
    if bt.dim() != 2 or bt.shape[0] != B:
        raise MetadataError("block_table", f"shape {tuple(bt.shape)} is not [B = {B}, blocks per request]",
                            "pass one row of block ids per request", value=tuple(bt.shape))
    if slots.dim() != 1:
        raise MetadataError("slot_mapping", f"shape {tuple(slots.shape)} is not [T]", "pass one slot per token",
                            value=tuple(slots.shape))
    T = slots.shape[0]
    if num_tokens is not None and num_tokens != T:
        raise MetadataError("slot_mapping", f"has {T} tokens but the step has {num_tokens}",
                            "build the metadata for the same tokens as input_ids (pad slot_mapping with -1)",
                            value=T)
    if pos is not None and pos.shape != slots.shape:
        raise MetadataError("positions", f"shape {tuple(pos.shape)} differs from slot_mapping's [T = {T}]",
                            "pass one position per token (0 for padding)", value=tuple(pos.shape))

    # -- values: every mask computed on clamped indices (nothing here may raise),
    # then one sync for all of them.
    qsl64, seq64, bt64, slots64 = (x.long() for x in (qsl, seq, bt, slots))
    pos64 = None if pos is None else pos.long()
    q_len = qsl64[1:] - qsl64[:-1]  # [B]
    nb = bt.shape[1]
    need = (seq64.clamp(min=0) + vbs - 1) // vbs  # [B] blocks each request reads
    col = torch.arange(nb, device=bt.device)
    used = col[None, :] < need[:, None]  # [B, nb]
    bad_block = used & ((bt64 < 0) | (bt64 >= num_blocks))
    end = qsl64[-1].clamp(0, T)
    t = torch.arange(T, device=slots.device)
    real = t < end
    req = (torch.searchsorted(qsl64[1:].contiguous(), t, right=True)).clamp(max=B - 1)
    p = (seq64 - q_len)[req] + (t - qsl64[req])  # [T] position of each real token
    blk = bt64[req, (p // vbs).clamp(0, max(nb - 1, 0))] if nb > 0 else torch.zeros_like(p)
    expect = blk * vbs + p % vbs
    bad_slot = torch.where(real, slots64 != expect, slots64 != -1)
    real_slots = torch.where(real, slots64, torch.full_like(slots64, -1))
    srt = torch.sort(real_slots).values
    dup = (srt[1:] == srt[:-1]) & (srt[1:] >= 0)
    masks = {
        "qsl0": qsl64[0] != 0,
        "qsl_dec": (q_len < 0).any(),
        "qsl_end": qsl64[-1] > T,
        "seq": (seq64 < q_len).any(),
        "width": (need > nb).any(),
        "block": bad_block.any(),
        "slot": bad_slot.any(),
        "dup": dup.any(),
    }
    if pos64 is not None:
        masks["pos"] = (real & (pos64 != p)).any()
    flags = dict(zip(masks, torch.stack(list(masks.values())).tolist()))
    if not any(flags.values()):
        return

    # -- a failure: locate it (host syncs are fine now).
    if flags["qsl0"]:
        raise MetadataError("query_start_loc", f"query_start_loc[0] = {int(qsl64[0])}, must be 0",
                            "start the cumulative token offsets at 0", value=int(qsl64[0]))
    if flags["qsl_dec"]:
        b = _first(q_len < 0)
        raise MetadataError("query_start_loc", f"decreases: query_start_loc[{b}] = {int(qsl64[b])} > "
                            f"query_start_loc[{b + 1}] = {int(qsl64[b + 1])}",
                            "query_start_loc must be non-decreasing (cumulative new-token counts)",
                            request=b, value=int(qsl64[b + 1]))
    if flags["qsl_end"]:
        raise MetadataError("query_start_loc", f"ends at {int(qsl64[-1])} but the step has only T = {T} tokens",
                            "query_start_loc[-1] must be <= len(slot_mapping) (padding comes after it)",
                            value=int(qsl64[-1]))
    if flags["seq"]:
        b = _first(seq64 < q_len)
        raise MetadataError("seq_lens", f"seq_lens = {int(seq64[b])} is smaller than the request's "
                            f"{int(q_len[b])} new tokens", "seq_lens counts context + new tokens: "
                            "set it to context_len + new_tokens", request=b, value=int(seq64[b]))
    if flags["width"]:
        b = _first(need > nb)
        raise MetadataError("block_table", f"has {nb} columns but seq_lens = {int(seq64[b])} needs "
                            f"{int(need[b])} blocks of {vbs} tokens",
                            f"widen the block table to >= {int(need.max())} columns (max_blocks_per_req) or "
                            "shorten the request", request=b, value=nb)
    if flags["block"]:
        b, j = divmod(_first(bad_block), nb)
        raise MetadataError("block_table", f"block_table[{b}, {j}] = {int(bt64[b, j])} is outside the cache's "
                            f"blocks [0, {num_blocks})", "use block ids from a BlockAllocator sized to this "
                            "cache (num_blocks; the last page of a scratch_block=True cache is its scratch "
                            "block, never a request's), or allocate more blocks", request=b, value=int(bt64[b, j]))
    if flags["slot"]:
        i = _first(bad_slot)
        if bool(real[i]):
            b = int(req[i])
            raise MetadataError("slot_mapping", f"slot_mapping[{i}] = {int(slots64[i])} but the token at position "
                                f"{int(p[i])} maps to slot {int(expect[i])} through block_table[{b}, "
                                f"{int(p[i]) // vbs}] (block of {vbs} tokens)",
                                "set slot = block_table[b, pos // block_tokens] * block_tokens + pos % "
                                "block_tokens for every new token (build_attention_metadata does)",
                                request=b, value=int(slots64[i]))
        raise MetadataError("slot_mapping", f"padding token {i} (at or past query_start_loc[-1] = {int(end)}) "
                            f"has slot {int(slots64[i])}; it would overwrite a cached token",
                            "give padding tokens slot -1", value=int(slots64[i]))
    if flags["dup"]:
        s = int(srt[1:][dup][0])
        toks = torch.nonzero(real_slots == s).flatten().tolist()
        b = int(req[toks[1]])
        raise MetadataError("slot_mapping", f"tokens {toks} all write slot {s} (requests share a block)",
                            "give each request its own blocks for the positions it writes", request=b, value=s)
    i = _first(real & (pos64 != p))
    b = int(req[i])
    raise MetadataError("positions", f"positions[{i}] = {int(pos64[i])} but the token is at position {int(p[i])} "
                        f"(seq_lens - new tokens + offset)", "set positions to the request-local position of "
                        "each token", request=b, value=int(pos64[i]))


def _cache_geometry(kv_caches: Sequence[Sequence[torch.Tensor]]) -> tuple[int, int, torch.device]:
    """(num_blocks, block_size, device) of this rank's caches.

    Every tensor is [num_blocks, page, ...] with one num_blocks (one block id means one
    page everywhere); the page size of the sharded caches is each layer's first
    tensor's (a replicated indexer cache may follow it with whole virtual blocks).
    """
    layers = [layer if isinstance(layer, (list, tuple)) else (layer,) for layer in kv_caches]
    tensors = [c for layer in layers for c in layer if isinstance(c, torch.Tensor) and c.dim() >= 2]
    if not tensors:
        raise MetadataError("kv_caches", "holds no cache tensors", "pass the per-layer caches of allocate_kv_cache")
    geo = {(c.shape[0], c.device) for c in tensors} | {(layer[0].shape[0], layer[0].device) for layer in layers}
    pages = {layer[0].shape[1] for layer in layers}
    if len(geo) != 1 or len(pages) != 1:
        shown = ", ".join(sorted(f"{n} blocks on {d}" for n, d in geo))
        raise MetadataError("kv_caches", f"cache tensors disagree: {shown}; pages of {sorted(pages)} tokens",
                            "allocate every layer's cache with one allocate_kv_cache call")
    (num_blocks, device), = geo
    # A cache allocated with scratch_block=True ends with the GE graphs' scratch block
    # (ops/core/scratch_block.py, issue 21): no block table may name it.
    num_blocks -= int(any(has_scratch_block(c) for c in tensors))
    return num_blocks, pages.pop(), device


def _refuse_sharded_caches(kv_caches: Sequence[Sequence[torch.Tensor]]) -> None:
    """No single-device attention op over a DCP / PCP-sharded cache (issue 19): the
    cache knows its layout (`allocate_kv_cache` marks its storage, `sharded_cache`);
    the ops refuse it too, this refuses it before the first layer runs."""
    refuse_sharded(((f"layer {i}'s cache", c) for i, layer in enumerate(kv_caches)
                    for c in (layer if isinstance(layer, (list, tuple)) else (layer,))),
                   "the step runs the single-device ops (uncompiled forward, or a backend other than cp_ascend)")


def validate_step(meta: AttentionMetadata, kv_caches: Sequence[Sequence[torch.Tensor]], cp: int | None = None,
                  num_tokens: int | None = None, single_device_ops: bool = False,
                  parallel: ParallelState | None = None) -> None:
    """Validate one step's metadata against this rank's caches before anything is written.

    kv_caches: one tuple of cache tensors per layer, each [num_blocks, block_size, ...]
    (this rank's shard). cp: ranks a virtual block is spread over (the cache's
    context-parallel group); else the size of `parallel`'s cp group (`ParallelState`);
    with neither, the current parallel state's, read here once (an eager front door:
    the compiled entry and the backend's step check pass `cp`), 1 without one. Run on every rank: the
    verdict depends only on global data, so all ranks
    refuse the same step before any collective. single_device_ops: the step runs the
    single-device attention ops as written (an eager forward, a backend other than
    cp_ascend): a DCP / PCP-sharded cache is then refused (ConfigError).
    """
    if single_device_ops:
        _refuse_sharded_caches(kv_caches)
    if cp is None:
        state = parallel if parallel is not None else parallel_state_or_none()
        cp = state.layout.cp.size if state is not None else 1
    num_blocks, block_size, device = _cache_geometry(kv_caches)
    sm = meta.slot_mapping
    if isinstance(sm, torch.Tensor) and sm.device != device:
        raise MetadataError("metadata", f"is on {meta.slot_mapping.device} but the KV cache is on {device}",
                            f"move it with meta.to({str(device)!r})", value=str(meta.slot_mapping.device))
    validate_metadata(meta, num_blocks=num_blocks, block_size=block_size, cp=cp, num_tokens=num_tokens)


def validate_forward_args(arguments: Mapping[str, Any], cp: int | None = None) -> None:
    """`validate_step` for a model forward's bound arguments (the compiled entry).

    Finds the `AttentionMetadata` argument, the KV caches (`kv_caches`, else the first
    list of per-layer tuples of tensors) and the token count (`input_ids`); warns
    (and checks nothing) when the forward takes no metadata or caches. `cp` as for
    `validate_step` (the compiled entry passes its context's cp size under cp_ascend, 1
    under any other backend: `decorator.validation_cp`); at cp = 1 the step runs the
    single-device ops, so a sharded cache is refused.
    """
    meta = next((v for v in arguments.values() if isinstance(v, AttentionMetadata)), None)
    caches = arguments.get("kv_caches")
    if caches is None:
        caches = next((v for v in arguments.values() if isinstance(v, (list, tuple)) and v
                       and all(isinstance(layer, (list, tuple)) and layer
                               and all(isinstance(c, torch.Tensor) for c in layer) for layer in v)), None)
    if meta is None or not caches:
        # Never silently nothing (issue 19): the step runs unchecked, say so.
        missing = " and ".join(n for n, v in (("AttentionMetadata", meta), ("kv_caches", caches)) if not v)
        warnings.warn(f"validate_forward_args: forward got no {missing} argument (arguments: "
                      f"{sorted(arguments)}), so this step's metadata is not checked against the caches. Fix: pass "
                      "them as arguments of forward (kv_caches: a list of per-layer tuples of tensors), or set "
                      "validate_inputs = False on the compiled entry to skip checking on purpose", stacklevel=2)
        return
    ids = arguments.get("input_ids")
    validate_step(meta, caches, cp=cp, num_tokens=ids.shape[0] if isinstance(ids, torch.Tensor) else None,
                  single_device_ops=cp == 1)
