"""Cache regions and byte descriptors: a `RankPlan` in addresses.

Each rank describes its cache tensors once (`regions_of`: address, bytes per slot,
bytes per KV head) and publishes that beside its transport metadata; the reading
rank turns a plan into (local, remote) descriptor arrays, one pair per source rank,
in NIXL's Nx3 form (address, length, device id). Whole-row runs are one descriptor
per run (a run of whole blocks is one descriptor per block range); a GQA run that
moves a subset of a row's KV heads is one descriptor per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cp_compile.serving.kv_transfer.plan import RankPlan


@dataclass(frozen=True)
class CacheRegion:
    """One cache tensor of one rank: `cache` is "k", "v", "latent" or "index", or a quantised
    cache's scales "k_scale", "v_scale", "latent_scale" (fp32, one per KV head / latent row)."""

    cache: str
    layer: int
    addr: int
    nbytes: int
    row_bytes: int  # bytes of one slot (token)
    head_bytes: int  # bytes of one KV head inside a row (GQA); row_bytes for latent / index rows
    device_id: int = 0


def regions_of(layers: list[tuple[torch.Tensor, ...]], replicated: list[torch.Tensor], kind: str,
               quantized: bool | None = None) -> tuple[CacheRegion, ...]:
    """Regions of a rank's caches (`KVCache.layers`, `.replicated`), in layer order.

    A quantised cache (`KVCache.kv_cache_dtype` int8 / fp8_e4m3, decision 65) has layers
    `(k, v, k_scale, v_scale)` / `(latent, latent_scale)`: the scale tensors are regions of
    their own, rows of `kv_heads * 4` bytes (heads of 4 bytes), so every plan run that moves
    a token's codes (or a subset of its KV heads) moves its scales too (decision 67).
    `quantized`: whether the cache is quantised (`KVCache.quantized`); None infers it from
    the number of tensors per layer."""
    plain = ("k", "v") if kind == "gqa" else ("latent",)
    names = plain + tuple(f"{n}_scale" for n in plain)
    out = []

    def region(name: str, layer: int, t: torch.Tensor) -> CacheRegion:
        if not t.is_contiguous():
            raise ValueError(f"{name} cache of layer {layer} is not contiguous; allocate it with allocate_kv_cache")
        if name.endswith("_scale") and t.dtype != torch.float32:
            raise ValueError(f"{name} cache of layer {layer} is {t.dtype}; a quantised cache's scales are fp32 "
                             f"(allocate it with allocate_kv_cache)")
        e = t.element_size()
        row = t[0, 0].numel() * e
        head = t[0, 0, 0].numel() * e if name in ("k", "v", "k_scale", "v_scale") else row
        dev = t.device.index if t.device.index is not None else 0
        return CacheRegion(name, layer, t.data_ptr(), t.numel() * e, row, head, dev)

    for i, layer in enumerate(layers):
        q = len(layer) == len(names) if quantized is None else quantized
        want = names if q else plain
        if len(layer) != len(want):
            raise ValueError(f"layer {i} has {len(layer)} cache tensors, a {'quantised ' if q else ''}{kind} cache "
                             f"has {len(want)} ({', '.join(want)})")
        out += [region(n, i, t) for n, t in zip(want, layer)]
    for i, t in enumerate(replicated):
        out.append(region("index", i, t))
    return tuple(out)


def _by_key(regions: tuple[CacheRegion, ...]) -> dict[tuple[str, int], CacheRegion]:
    return {(r.cache, r.layer): r for r in regions}


def descriptors(plan: RankPlan, local: tuple[CacheRegion, ...], remote: dict[int, tuple[CacheRegion, ...]],
                layer: int | None = None) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """src rank -> (local Nx3, remote Nx3) uint64 descriptor arrays (address, bytes, device),
    for every layer or only `layer` (the connector reads layer by layer)."""
    mine = _by_key(local)
    theirs = {r: _by_key(regs) for r, regs in remote.items()}
    parts: dict[int, tuple[list[np.ndarray], list[np.ndarray]]] = {}
    for run in plan.runs:
        keys = [k for k in mine if (k[0] == "index") == (run.cache == "index") and layer in (None, k[1])]
        loc_l, rem_l = parts.setdefault(run.src_rank, ([], []))
        for key in keys:
            d, s = mine[key], theirs[run.src_rank][key]
            if run.num_heads == 0 or (run.num_heads * d.head_bytes == d.row_bytes == s.row_bytes):
                if d.row_bytes != s.row_bytes:
                    raise ValueError(f"{key}: rows of {s.row_bytes} bytes on the prefill rank, {d.row_bytes} here")
                t = np.zeros(1, dtype=np.uint64)
                length = run.num_tokens * d.row_bytes
                loc_l.append(np.stack([t + d.addr + run.dst_slot * d.row_bytes, t + length, t + d.device_id], 1))
                rem_l.append(np.stack([t + s.addr + run.src_slot * s.row_bytes, t + length, t + s.device_id], 1))
            else:  # a head subset of each row: one descriptor per token
                k = np.arange(run.num_tokens, dtype=np.uint64)
                length = run.num_heads * d.head_bytes
                ones = np.ones_like(k)
                loc_l.append(np.stack([d.addr + (run.dst_slot + k) * d.row_bytes + run.dst_head * d.head_bytes,
                                       ones * length, ones * d.device_id], 1))
                rem_l.append(np.stack([s.addr + (run.src_slot + k) * s.row_bytes + run.src_head * s.head_bytes,
                                       ones * length, ones * s.device_id], 1))
    return {r: (np.concatenate(l).astype(np.uint64), np.concatenate(m).astype(np.uint64))
            for r, (l, m) in parts.items()}


def check_in_regions(descs: np.ndarray, regions: tuple[CacheRegion, ...], who: str) -> None:
    """Every descriptor lies inside one region (a plan bug would otherwise write a
    neighbour's memory on a transport that does not check, as NIXL does for remote
    memory but not for the local side)."""
    addr, end = descs[:, 0], descs[:, 0] + descs[:, 1]
    inside = np.zeros(len(descs), dtype=bool)
    for r in regions:
        inside |= (addr >= r.addr) & (end <= r.addr + r.nbytes)
    if not inside.all():
        a, n = descs[int(np.argmin(inside))][:2].tolist()
        raise ValueError(f"descriptor ({a:#x}, {n} bytes) lies outside every {who} cache region")
