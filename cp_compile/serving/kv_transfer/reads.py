"""One layer's reads for one request: coalesced descriptors, plus a local scatter.

`regions.descriptors` turns each `SlotRun` into descriptors as it stands. Under token
interleave a run is a few tokens (often one: consecutive positions alternate
between cp ranks), so a 16k-token request is ~10^5 descriptors of a few hundred
bytes per rank and layer, and NIXL / UCX pays per descriptor (0.001 GB/s measured,
against 0.05 GB/s for whole blocks). Two things make them few:

1. sort a source rank's runs by source slot and merge the runs that are contiguous
   on both sides (one descriptor per maximal run, across run and block boundaries);
2. a source-contiguous stretch whose destination slots are scattered (P at cp N
   stores its tokens densely, D at another cp size or interleave strides them) is
   read with ONE descriptor into a registered staging buffer on this rank, and then
   copied into its slots with one row-indexed copy per cache tensor (`LayerReads.scatter`;
   numpy fancy assignment on CPU, `index_copy_` on devices),
   the local copy being far cheaper than a descriptor per token. A stretch whose
   direct runs average at least `stage_below` bytes stays direct (whole blocks do:
   no extra copy on the block path).

Bytes read are the same as uncoalesced (every token once); a run that moves a subset
of a row's KV heads (GQA, the two sides' TP split heads differently) stays one
descriptor per token: its bytes are not contiguous on the source.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from cp_compile.serving.kv_transfer.plan import RankPlan, SlotRun
from cp_compile.serving.kv_transfer.regions import CacheRegion, descriptors

STAGE_BELOW = 8192  # bytes: runs shorter than this on average are staged (8 KiB ~ UCX's per-op overhead break-even)


@dataclass(frozen=True)
class Scatter:
    """Rows [offset, offset + rows * row_bytes) of the staging buffer into slots `dst_slots` of local region `region`."""

    region: int
    offset: int
    row_bytes: int
    dst_slots: np.ndarray  # int64 [rows]


@dataclass
class LayerReads:
    """Per source rank: (local Nx3, remote Nx3) descriptors; rows flagged in `staged`
    address the staging buffer (their address is an offset until `bind`)."""

    per_src: dict[int, tuple[np.ndarray, np.ndarray]]
    staged: dict[int, np.ndarray] = field(default_factory=dict)  # bool [N] per source rank
    scatters: list[Scatter] = field(default_factory=list)
    staging_bytes: int = 0

    @property
    def num_descriptors(self) -> int:
        return sum(len(loc) for loc, _ in self.per_src.values())

    def bind(self, staging_addr: int, device_id: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The descriptors with staged rows pointing into a staging buffer at `staging_addr`."""
        out = {}
        for s, (loc, rem) in self.per_src.items():
            loc = loc.copy()
            mask = self.staged.get(s)
            if mask is not None and mask.any():
                loc[mask, 0] += np.uint64(staging_addr)
                loc[mask, 2] = np.uint64(device_id)
            out[s] = (loc, rem)
        return out

    def scatter(self, tensors: list[torch.Tensor], staging: torch.Tensor) -> None:
        """Copy the staged rows into their slots (`tensors`: the local regions' tensors, in order)."""
        for sc in self.scatters:
            t = tensors[sc.region]
            n = len(sc.dst_slots)
            # rows in the widest integer type dividing them (byte-wise index_copy_ is ~10x slower)
            word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                        if sc.row_bytes % w.itemsize == 0 and sc.offset % w.itemsize == 0)
            rows = t.view(-1).view(torch.uint8).view(word).view(-1, sc.row_bytes // word.itemsize)
            src = staging[sc.offset: sc.offset + n * sc.row_bytes].view(word).view(n, -1)
            if t.device.type == "cpu":  # numpy's fancy assignment: ~40x torch's CPU index_copy_ here (measured)
                rows.numpy()[sc.dst_slots] = src.numpy()
            else:
                rows.index_copy_(0, torch.from_numpy(sc.dst_slots).to(t.device), src)


def _whole_row(run: SlotRun, d: CacheRegion, s: CacheRegion) -> bool:
    return run.num_heads == 0 or run.num_heads * d.head_bytes == d.row_bytes == s.row_bytes


def _segments(runs: list[SlotRun]) -> tuple[np.ndarray, ...]:
    """Runs sorted by source slot, merged where contiguous on both sides:
    (src slot, dst slot, tokens, source-contiguous group id) per segment."""
    ss = np.array([r.src_slot for r in runs], dtype=np.int64)
    ds = np.array([r.dst_slot for r in runs], dtype=np.int64)
    nn = np.array([r.num_tokens for r in runs], dtype=np.int64)
    order = np.argsort(ss, kind="stable")
    ss, ds, nn = ss[order], ds[order], nn[order]
    src_brk = np.ones(len(ss), dtype=bool)
    src_brk[1:] = ss[1:] != ss[:-1] + nn[:-1]
    seg_brk = src_brk.copy()
    seg_brk[1:] |= ds[1:] != ds[:-1] + nn[:-1]
    starts = np.flatnonzero(seg_brk)
    seg_n = np.add.reduceat(nn, starts)
    group = np.cumsum(src_brk)[starts] - 1
    return ss[starts], ds[starts], seg_n, group


def _desc(addr: np.ndarray, length: np.ndarray, dev: int) -> np.ndarray:
    return np.stack([addr.astype(np.uint64), length.astype(np.uint64),
                     np.full(len(addr), dev, dtype=np.uint64)], 1)



@dataclass(frozen=True)
class RunGroups:
    """A plan's runs split by what their descriptors need, for one row geometry: per
    (src rank, "kv" | "index") the whole-row runs' merged segments (`_segments` plus
    segments and tokens per source-contiguous group), and the head-subset runs. The same
    for every layer whose rows have the same sizes, so `read_plan` builds it once per
    request (a Python pass over every run: the token path's main host cost per layer)."""

    whole: dict[tuple[int, str], tuple[np.ndarray, ...]]
    partial: tuple[SlotRun, ...]


def group_runs(plan: RankPlan, local: tuple[CacheRegion, ...], remote: dict[int, tuple[CacheRegion, ...]],
               layer: int) -> RunGroups:
    """`RunGroups` of `plan` under the row sizes of `layer`'s regions."""
    mine = {(r.cache, r.layer): i for i, r in enumerate(local)}
    theirs = {s: {(r.cache, r.layer): r for r in regs} for s, regs in remote.items()}
    keys = [k for k in mine if k[1] == layer]
    runs_of: dict[tuple[int, str], list[SlotRun]] = {}  # (src rank, "kv" | "index") -> runs
    partial = []
    is_whole: dict[tuple[int, str, int], bool] = {}  # depends on (src rank, cache, num_heads) only
    for run in plan.runs:
        kind = (run.src_rank, run.cache, run.num_heads)
        if kind not in is_whole:
            ks = [k for k in keys if (k[0] == "index") == (run.cache == "index")]
            is_whole[kind] = all(_whole_row(run, local[mine[k]], theirs[run.src_rank][k]) for k in ks)
        if is_whole[kind]:
            runs_of.setdefault((run.src_rank, run.cache), []).append(run)
        else:
            partial.append(run)
    whole = {}
    for key, runs in runs_of.items():
        seg_src, seg_dst, seg_n, group = _segments(runs)
        whole[key] = (seg_src, seg_dst, seg_n, group, np.bincount(group),
                      np.bincount(group, weights=seg_n).astype(np.int64))
    return RunGroups(whole, tuple(partial))


def same_rows(local: tuple[CacheRegion, ...], remote: dict[int, tuple[CacheRegion, ...]]) -> bool:
    """Every layer's regions of one cache have the same row and head sizes, here and on
    every source rank (so one `RunGroups` serves all layers)."""
    for regs in (local, *remote.values()):
        sizes: dict[str, tuple[int, int]] = {}
        for r in regs:
            if sizes.setdefault(r.cache, (r.row_bytes, r.head_bytes)) != (r.row_bytes, r.head_bytes):
                return False
    return True


def layer_reads(plan: RankPlan, local: tuple[CacheRegion, ...], remote: dict[int, tuple[CacheRegion, ...]],
                layer: int, coalesce: bool = True, stage_below: int = STAGE_BELOW,
                groups: RunGroups | None = None) -> LayerReads:
    """The reads of `layer` (its K/V or latent and, SFA, its indexer pages); `groups`:
    `group_runs` of the plan for rows of this layer's sizes (built here if None)."""
    if not coalesce:
        return LayerReads(descriptors(plan, local, remote, layer=layer))
    mine = {(r.cache, r.layer): i for i, r in enumerate(local)}
    theirs = {s: {(r.cache, r.layer): r for r in regs} for s, regs in remote.items()}
    keys = [k for k in mine if k[1] == layer]
    if groups is None:
        groups = group_runs(plan, local, remote, layer)
    partial = list(groups.partial)
    loc_l: dict[int, list[np.ndarray]] = {}
    rem_l: dict[int, list[np.ndarray]] = {}
    stg_l: dict[int, list[np.ndarray]] = {}

    def emit(s: int, loc: np.ndarray, rem: np.ndarray, staged: bool) -> None:
        loc_l.setdefault(s, []).append(loc)
        rem_l.setdefault(s, []).append(rem)
        stg_l.setdefault(s, []).append(np.full(len(loc), staged))

    out = LayerReads({})
    for (s, cache), (seg_src, seg_dst, seg_n, group, nseg, gtok) in groups.whole.items():
        for k in [k for k in keys if (k[0] == "index") == (cache == "index")]:
            d, r = local[mine[k]], theirs[s][k]
            if d.row_bytes != r.row_bytes:
                raise ValueError(f"{k}: rows of {r.row_bytes} bytes on the prefill rank, {d.row_bytes} here")
            R = d.row_bytes
            stage_g = (nseg > 1) & (gtok * R < stage_below * nseg)
            direct = ~stage_g[group]
            if direct.any():
                emit(s, _desc(d.addr + seg_dst[direct] * R, seg_n[direct] * R, d.device_id),
                     _desc(r.addr + seg_src[direct] * R, seg_n[direct] * R, r.device_id), False)
            if stage_g.any():
                gs = np.flatnonzero(stage_g)
                first = np.searchsorted(group, gs)  # each staged group's first segment (segments sorted by src)
                nbytes = gtok[gs] * R
                offs = out.staging_bytes + np.concatenate([[0], np.cumsum(nbytes)[:-1]])
                emit(s, _desc(offs, nbytes, 0), _desc(r.addr + seg_src[first] * R, nbytes, r.device_id), True)
                sel = ~direct
                n_sel, d_sel = seg_n[sel], seg_dst[sel]
                tok_start = np.repeat(np.cumsum(n_sel) - n_sel, n_sel)
                dst_slots = np.repeat(d_sel, n_sel) + (np.arange(int(n_sel.sum())) - tok_start)
                out.scatters.append(Scatter(mine[k], out.staging_bytes, R, dst_slots))
                out.staging_bytes += int(nbytes.sum())
    if partial:
        for s, (loc, rem) in descriptors(RankPlan(plan.dst_rank, tuple(partial), plan.dst_blocks), local, remote,
                                         layer=layer).items():
            emit(s, loc, rem, False)
    for s in loc_l:
        out.per_src[s] = (np.concatenate(loc_l[s]).astype(np.uint64), np.concatenate(rem_l[s]).astype(np.uint64))
        out.staged[s] = np.concatenate(stg_l[s])
    return out
