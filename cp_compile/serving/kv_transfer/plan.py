"""Transfer planning: which bytes of which prefill rank go to which slots of a decode rank.

Pure math over the two layouts (no transport, no state). For a request of n tokens
with P virtual block table `src_blocks` and D virtual block table `dst_blocks`:

- sharded caches (GQA K/V, MLA / SFA latent): D rank d receives exactly the positions
  its cp rank owns under D's layout (`ops/core/layout.py: token_owner`), each from a P
  rank whose cp rank owns it under P's layout, at the slots both layouts give it
  (`block * block_size + local_offset`). GQA: the D rank's KV heads are cut into
  segments by the P TP ranks' head sets (each side's `tp_kv_head_ids`); a segment
  is read from a P rank holding those heads. Among P replicas of the same data (TP
  ranks holding the same heads and tokens) the D rank picks `d % replicas`, so D's
  own replicas read from different P ranks.
- a quantised cache's scale tensors (decision 65: fp32, at the same (page, offset) as
  their codes, one per KV head or one per latent row) are more "kv" regions: the same
  runs move them, `num_heads * 4` bytes per token (decision 67).
- the replicated indexer cache (SFA): every D rank receives every position, in
  D's full virtual-block pages, from P rank `d % P world size`.

Consecutive positions whose source rank is the same and whose source and
destination slots both advance by one merge into one `SlotRun`: with
interleave == block_size and equal block sizes a run is a whole block (or more),
with token interleave the general case is runs of `min(I_P, I_D)`-ish tokens.
Every destination element is written by exactly one run (`tests/.../test_plan.py`
checks it against brute-force ownership), so the bytes moved are
`expected_bytes` (every token once per D copy, no duplicates).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from cp_compile.serving.kv_transfer.layout import KVGeometry, KVLayout
from cp_compile.ops.core.layout import local_len, local_offset, token_owner


class SlotRun(NamedTuple):  # a NamedTuple: a 16k-token request makes ~10^4 of them, a frozen dataclass is 3x slower
    """`num_tokens` consecutive slots of P rank `src_rank` (from `src_slot`) into this D
    rank's slots from `dst_slot`. cache "kv": the sharded K/V (or latent) pages, slot =
    page * block_size + offset, heads [src_head, src_head + num_heads) of P's row into
    [dst_head, ...) of D's (num_heads 0: the whole row, latent caches); cache "index":
    the replicated indexer pages, slot = page * virtual_block_size + offset."""

    cache: str
    src_rank: int
    src_slot: int
    dst_slot: int
    num_tokens: int
    src_head: int = 0
    dst_head: int = 0
    num_heads: int = 0


@dataclass(frozen=True)
class RankPlan:
    """Everything D rank `dst_rank` reads for one request."""

    dst_rank: int
    runs: tuple[SlotRun, ...]
    dst_blocks: tuple[int, ...]  # D virtual block ids the runs write (checked against ownership)

    def bytes(self, geometry: KVGeometry) -> int:
        """Bytes the runs move into this rank (all layers)."""
        return sum(r.num_tokens * _token_bytes(geometry, r) for r in self.runs)

    def src_ranks(self) -> tuple[int, ...]:
        return tuple(sorted({r.src_rank for r in self.runs}))


def _token_bytes(geometry: KVGeometry, run: SlotRun) -> int:
    e, layers = geometry.element_size, geometry.num_layers
    if run.cache == "index":
        return geometry.index_dim * geometry.index_element_size * layers
    sc = geometry.scale_bytes_per_head()  # a quantised cache: each token's scales move with its codes
    if geometry.kind == "gqa":
        return run.num_heads * ((geometry.head_dim + geometry.v_head_dim) * e + 2 * sc) * layers
    return (geometry.latent_dim * e + sc) * layers


def expected_bytes(geometry: KVGeometry, dst: KVLayout, num_tokens: int) -> int:
    """The formula: bytes a request of `num_tokens` tokens moves into the whole D instance.

    Sharded caches: each token lands once on each of the tp / dcp D ranks that share
    its cp rank (D's TP replicas), with that rank's KV heads (GQA) or the latent;
    the replicated indexer: each token once on every D rank.
    """
    e, layers, sc = geometry.element_size, geometry.num_layers, geometry.scale_bytes_per_head()
    copies = dst.tensor_parallel_size // dst.decode_context_parallel_size
    if geometry.kind == "gqa":
        heads = len(geometry.kv_heads_of(dst, 0))
        total = num_tokens * copies * heads * ((geometry.head_dim + geometry.v_head_dim) * e + 2 * sc) * layers
    else:
        total = num_tokens * copies * (geometry.latent_dim * e + sc) * layers
    if geometry.kind == "sfa":
        total += num_tokens * dst.world_size * geometry.index_dim * geometry.index_element_size * layers
    return total


def expected_rank_bytes(geometry: KVGeometry, dst: KVLayout, num_tokens: int, rank: int) -> int:
    """The same for one D rank: the tokens its cp rank owns (`local_len`, §5) with its
    KV heads (or the latent), plus every token of the replicated indexer (SFA)."""
    e, layers, sc = geometry.element_size, geometry.num_layers, geometry.scale_bytes_per_head()
    mine = int(local_len(torch.tensor(num_tokens), cp=dst.context_parallel_size, rank=dst.coords(rank).cp_rank,
                         interleave=dst.cp_kv_cache_interleave_size))
    if geometry.kind == "gqa":
        heads = len(geometry.kv_heads_of(dst, rank))
        row = heads * ((geometry.head_dim + geometry.v_head_dim) * e + 2 * sc)
    else:
        row = geometry.latent_dim * e + sc
    index = num_tokens * geometry.index_dim * geometry.index_element_size if geometry.kind == "sfa" else 0
    return (mine * row + index) * layers


def _blocks_needed(num_tokens: int, vbs: int) -> int:
    return -(-num_tokens // vbs)


def _check_table(name: str, blocks: Sequence[int], num_tokens: int, vbs: int) -> torch.Tensor:
    need = _blocks_needed(num_tokens, vbs)
    if len(blocks) < need:
        raise ValueError(f"{name} has {len(blocks)} blocks but {num_tokens} tokens need {need} blocks of {vbs}. "
                         f"Fix: pass the request's whole block table")
    if any(int(b) < 0 for b in blocks[:need]):
        raise ValueError(f"{name} {list(blocks[:need])} holds a negative block id. Fix: pass allocated block ids")
    return torch.tensor([int(b) for b in blocks[:need]], dtype=torch.int64)


def _slots(pos: torch.Tensor, table: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """Physical slot (page * block_size + local offset) of request-local positions under `layout`."""
    n, bs, i = layout.context_parallel_size, layout.block_size, layout.cp_kv_cache_interleave_size
    return table[pos // layout.virtual_block_size] * bs + local_offset(pos, cp=n, interleave=i, block_size=bs)


def _owner(pos: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    return token_owner(pos, cp=layout.context_parallel_size, interleave=layout.cp_kv_cache_interleave_size,
                       block_size=layout.block_size)


def _runs(cache: str, src_rank: torch.Tensor, src_slot: torch.Tensor, dst_slot: torch.Tensor,
          src_head: int, dst_head: int, num_heads: int) -> list[SlotRun]:
    """Merge consecutive entries (same source rank, both slots +1) into runs."""
    if src_rank.numel() == 0:
        return []
    brk = ((src_rank[1:] != src_rank[:-1]) | (src_slot[1:] != src_slot[:-1] + 1)
           | (dst_slot[1:] != dst_slot[:-1] + 1))
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.nonzero(brk).flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([src_rank.numel()])])
    # plain ints first: indexing a tensor per run costs microseconds each (16k-token requests)
    ranks, ss, ds = src_rank[starts].tolist(), src_slot[starts].tolist(), dst_slot[starts].tolist()
    return [SlotRun(cache, r, a, b, n, src_head, dst_head, num_heads)
            for r, a, b, n in zip(ranks, ss, ds, (ends - starts).tolist())]


def _head_segments(geometry: KVGeometry, src: KVLayout, dst: KVLayout, dst_rank: int
                   ) -> list[tuple[tuple[int, ...], int, int, int]]:
    """(P head set, src head offset, dst head offset, heads) per P head set meeting D's heads.
    Latent caches: one segment over the whole row (heads 0)."""
    if geometry.kind != "gqa":
        return [((), 0, 0, 0)]
    mine = geometry.kv_heads_of(dst, dst_rank)
    segs = []
    for heads in dict.fromkeys(geometry.kv_heads_of(src, r) for r in range(src.tensor_parallel_size)):
        common = [h for h in mine if h in heads]
        if common:
            segs.append((heads, heads.index(common[0]), mine.index(common[0]), len(common)))
    return segs


def _source_by_cp(geometry: KVGeometry, src: KVLayout, heads: tuple[int, ...], dst_rank: int) -> torch.Tensor:
    """[P cp size]: the P world rank D rank `dst_rank` reads cp rank c's tokens (of `heads`) from."""
    out = []
    for c in range(src.context_parallel_size):
        cands = [r for r in range(src.world_size)
                 if src.coords(r).cp_rank == c and geometry.kv_heads_of(src, r) == heads]
        if not cands:  # a layout the config rules refuse (DCP ranks holding different heads)
            raise ValueError(f"no prefill rank of cp rank {c} holds KV heads {heads} under {src.describe()}. "
                             f"Fix: a valid prefill layout (cfg.validate_for(model.attention_spec()))")
        out.append(cands[dst_rank % len(cands)])
    return torch.tensor(out, dtype=torch.int64)


def plan_rank(src: KVLayout, dst: KVLayout, geometry: KVGeometry, num_tokens: int, src_blocks: Sequence[int],
              dst_blocks: Sequence[int], dst_rank: int) -> RankPlan:
    """The reads D rank `dst_rank` posts for a request of `num_tokens` tokens."""
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens}: a transferred request holds at least one token")
    src_table = _check_table("prefill block table", src_blocks, num_tokens, src.virtual_block_size)
    dst_table = _check_table("decode block table", dst_blocks, num_tokens, dst.virtual_block_size)
    me = dst.coords(dst_rank)
    pos = torch.arange(num_tokens, dtype=torch.int64)
    mine = pos[_owner(pos, dst) == me.cp_rank]  # positions this D rank stores
    dst_slot = _slots(mine, dst_table, dst)
    src_slot = _slots(mine, src_table, src)
    src_cp = _owner(mine, src)
    runs: list[SlotRun] = []
    for heads, src_head, dst_head, n in _head_segments(geometry, src, dst, dst_rank):
        src_rank = _source_by_cp(geometry, src, heads, dst_rank)[src_cp]
        runs += _runs("kv", src_rank, src_slot, dst_slot, src_head, dst_head, n)
    if geometry.kind == "sfa":  # replicated indexer: every position, full virtual-block pages
        vs, vd = src.virtual_block_size, dst.virtual_block_size
        isrc = src_table[pos // vs] * vs + pos % vs
        idst = dst_table[pos // vd] * vd + pos % vd
        runs += _runs("index", torch.full_like(pos, dst_rank % src.world_size), isrc, idst, 0, 0, 0)
    return RankPlan(dst_rank, tuple(runs), tuple(int(b) for b in dst_table.tolist()))
