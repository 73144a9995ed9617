"""CPU kernels of the paged attention ops: each page read once, in place, flash-style (issue 26).

The references (`reference.paged_attention_with_lse`) loop over requests in Python,
gather each request's whole K/V as an fp32 copy and materialise `[H, t, n]` scores:
the oracle, not a kernel. These kernels compute the same thing (out in q's dtype,
fp32 natural-log LSE, a query with no keys gets out 0 and lse -inf) as follows:

- **Requests batched, not looped.** Requests are grouped by their number of query
  tokens (power-of-two classes, so padding wastes at most 2x); each group is one
  padded batch `[Bg, Tq]`. Decode is one group. The `g = Hq / Hkv` query heads of a
  KV head are folded into the query rows (`[Bg, Hkv, Tq * g, D]`), so GQA reads each
  KV head once for all its query heads.
- **KV read in chunks, merged by LSE.** Keys are walked in chunks of whole pages;
  each chunk goes through torch's CPU flash kernel
  (`aten._scaled_dot_product_flash_attention_for_cpu`, blocked online softmax in
  C++, returns the LSE) and the chunks are merged exactly by their LSEs. Chunks past
  every row's `kv_lens` are never read; a mask is built only for a chunk that some
  row's `kv_lens` cuts.
- **In place when the block table allows it.** When every request's pages are
  consecutive page ids and the requests' first pages are evenly spaced (what a
  fresh allocator hands out), the batch's K/V is a strided view of the cache: no
  copy at all. Otherwise each chunk's pages are gathered (`index_select`, a chunk
  of a few MiB that stays in cache) and read from there. In both cases the cache
  is read in its own dtype; a bf16 / fp16 cache is converted to fp32 a chunk at a time
  (the flash kernel computes in fp32, like the reference; the output is rounded once).
- **Nothing past a request's keys reaches a result.** Whole pages are read (and, in
  a padded batch, up to the longest request), so a chunk holds slots past a request's
  largest kv_len: garbage in a `torch.empty` cache, NaN in a rolled-back draft slot.
  The mask alone cannot cancel a NaN (q.k is NaN before it, 0 * NaN in P @ V), so in
  a chunk reaching past some request's prefix each request reads exactly its own keys
  (`_flash_per_request`, one call per request, still views); the chunks every row sees
  in full go through one batched call, unmasked.
- **Decode and verify in C.** A group with few query rows per KV head (<= 64: decode,
  spec-decode verify) in fp32 goes to `cpu_decode` (ops/paged/cpu_decode.c): one pass over each
  request's keys through the block table, in place whatever the table; what it does not
  cover (prefill tiles, bf16, odd head dims, no compiler / AVX2) takes the path below.
- **Quantised caches (issue 39).** An int8 / fp8 cache is read like a bf16 one (in place
  or gathered, a chunk at a time) together with its per-row scales (the same pages, a
  `[.., Hkv, 1]` view), and each chunk is dequantised to fp32 (`q * scale`) before the
  flash kernel; the C decode kernel takes them too (a block's rows dequantised as it reads them).
- **O(T) memory in prefill.** Query rows are tiled (a few thousand rows per tile),
  a tile reads only the chunks its rows can see (the causal skip), and no
  `[H, T, T]` scores exist: the flash kernel keeps its scores per block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from cp_compile.ops.core import kv_quant
from cp_compile.ops.paged import cpu_decode
from cp_compile.ops.core.layout import request_index

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# Query rows (tokens x folded heads x requests) per tile, and the bytes of one gathered
# K+V chunk: large enough to amortise Python per call, small enough to stay in L2/L3.
ROWS_PER_TILE = 4096
CHUNK_BYTES = 4 << 20
# A chunk read in place (a view) has no copy to keep small; its size only bounds the
# mask of a chunk that kv_lens cuts (rows x chunk elements).
VIEW_CHUNK_TOKENS = 16384
MASK_ELEMS = 1 << 22


def _compute_dtype(q: Tensor, cache: Tensor) -> torch.dtype:
    """fp32 at least, like the reference: torch's flash kernel on bf16 operands gives an LSE
    ~4e-5 from the fp32 one (beyond the GE check's fp32 tolerance, tools/ge_eval/probe.py) and
    rounds its probabilities to bf16; and bf16 GEMMs are emulated on a CPU without AVX512-BF16."""
    return torch.promote_types(torch.promote_types(q.dtype, cache.dtype), torch.float32)


def _v_is_k_prefix(k_cache: Tensor, v_cache: Tensor) -> bool:
    """MLA: the values are the first Dv columns of the keys (the same memory)."""
    if v_cache.data_ptr() != k_cache.data_ptr() or v_cache.shape[:3] != k_cache.shape[:3]:
        return False
    # strides of size-1 dims carry no meaning (unsqueeze makes them differ)
    same = all(k_cache.stride(i) == v_cache.stride(i) for i in range(3) if k_cache.shape[i] > 1)
    return same and v_cache.stride(3) == k_cache.stride(3) and v_cache.shape[3] <= k_cache.shape[3]


def _strided_view(cache: Tensor, table: Tensor, need: Tensor) -> Tensor | None:
    """The batch's pages as one view [Bg, pages * BS, Hkv, D] when the used block-table
    entries are `base + b * stride + j` and the view stays inside the cache; else None."""
    Bg, width = table.shape
    NB, BS = cache.shape[0], cache.shape[1]
    if width == 0 or cache.stride(0) != BS * cache.stride(1):
        return None
    base = table[:1, :1]
    step = table[1:2, :1] - base if Bg > 1 else torch.zeros_like(base)
    j = torch.arange(width, device=table.device)
    expect = base + step * torch.arange(Bg, device=table.device)[:, None] + j[None, :]
    used = j[None, :] < need[:, None]
    ok, b0, s = torch.stack([((table == expect) | ~used).all().long(), base[0, 0], step[0, 0]]).tolist()
    if not ok or b0 < 0 or s < 0 or b0 + (Bg - 1) * s + width > NB:
        return None
    st = cache.stride()
    return cache.as_strided((Bg, width * BS, cache.shape[2], cache.shape[3]), (s * st[0], st[1], st[2], st[3]),
                            cache.storage_offset() + b0 * st[0])


def _gather(cache: Tensor, pages: Tensor, bufs: dict[str, Tensor], key: str) -> Tensor:
    """cache[pages] -> [len(pages), BS, ...] into a buffer reused across chunks (a 2-D
    `index_select` of whole pages: one memcpy per page)."""
    if not cache.is_contiguous():
        return cache.index_select(0, pages)
    flat = cache.view(cache.shape[0], -1)
    buf = bufs.get(key)
    if buf is None or buf.shape[0] < pages.shape[0]:
        buf = bufs[key] = torch.empty(pages.shape[0], flat.shape[1], dtype=cache.dtype)
    out = buf[: pages.shape[0]]
    torch.index_select(flat, 0, pages, out=out)
    return out.view(pages.shape[0], *cache.shape[1:])


def _flash_chunk(qt: Tensor, k: Tensor, v: Tensor, kvl: Tensor, c0: int, masked: bool, g: int,
                 scale: float) -> tuple[Tensor, Tensor]:
    """One chunk: qt [Bg, Hkv, rows, D], k/v [Bg, n, Hkv, D|Dv] (keys c0..c0+n-1),
    kvl [Bg, tq] -> out [Bg, Hkv, rows, Dv], lse [Bg, Hkv, rows] fp32 (-inf: no key)."""
    Bg, n = k.shape[0], k.shape[1]
    tq = kvl.shape[1]
    mask = None
    if masked:
        pos = c0 + torch.arange(n, device=k.device)
        valid = pos[None, None, :] < kvl[:, :, None]  # [Bg, tq, n]
        if tq == 1:  # decode: every folded head of a token shares its keys
            valid = valid[:, None]  # [Bg, 1, 1, n]
        else:
            valid = valid[:, :, None, :].expand(Bg, tq, g, n).reshape(Bg, 1, tq * g, n)
        mask = torch.zeros(valid.shape, dtype=qt.dtype, device=qt.device).masked_fill_(~valid, float("-inf"))
    out, lse = _flash(qt, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    # The flash kernel reports lse 0 for a row whose keys are all masked: no key is -inf.
    empty = (kvl <= c0)[:, None, :, None].expand(Bg, 1, tq, g).reshape(Bg, 1, tq * g)
    return out, lse.float().masked_fill(empty, float("-inf"))


def _flash_per_request(qt: Tensor, k: Tensor, v: Tensor, kvl: Tensor, lim: list[int], c0: int, c1: int, g: int,
                       scale: float) -> tuple[Tensor, Tensor]:
    """A chunk (keys c0..c1-1) that reaches past some request's readable prefix lim[b]:
    request b reads keys c0..min(c1, lim[b])-1 only, a view, so no slot past its prefix
    enters the flash kernel. The mask alone would not do: it gives such a key weight 0, but
    q.k of a NaN key is NaN before the mask and 0 * NaN is NaN in P @ V, and a NaN partial
    is read as empty by an LSE merge (a finite, wrong answer). Shapes as `_flash_chunk`."""
    Bg, Hkv, R = qt.shape[0], qt.shape[1], qt.shape[2]
    out = qt.new_zeros(Bg, Hkv, R, v.shape[-1])
    lse = torch.full((Bg, Hkv, R), float("-inf"), dtype=torch.float32)
    for b, lb in enumerate(lim):
        nb = min(c1, lb) - c0
        if nb <= 0:
            continue
        # one query token (decode) sees all nb keys; several need the causal mask
        o, l = _flash_chunk(qt[b:b + 1], k[b:b + 1, :nb], v[b:b + 1, :nb], kvl[b:b + 1], c0, kvl.shape[1] > 1, g, scale)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def _merge(acc: Tensor, lse: Tensor, out: Tensor, l: Tensor) -> tuple[Tensor, Tensor]:
    """Running (acc fp32, lse) and a new chunk's (out, l) -> merged, exact by LSE."""
    new = torch.logaddexp(lse, l)
    fin = torch.isfinite(new)
    w_old = torch.where(fin, torch.exp(lse - new), torch.zeros_like(new))
    w_new = torch.where(fin, torch.exp(l - new), torch.zeros_like(new))
    return acc * w_old[..., None] + out.float() * w_new[..., None], new


def _attend_c(qp: Tensor, kvl: Tensor, k_cache: Tensor, v_cache: Tensor, tbl: Tensor, width: int, scale: float,
              k_scales: Tensor | None = None, v_scales: Tensor | None = None) -> tuple[Tensor, Tensor] | None:
    """The C kernel (`cpu_decode`) on a group with few query rows per KV head (decode, verify):
    [Bg, Tq, Hq, D] -> (out [Bg, Tq, Hq, Dv], lse [Bg, Tq, Hq]), or None where it does not apply."""
    Bg, Tq, Hq, D = qp.shape
    Hkv = k_cache.shape[2]
    g = Hq // Hkv
    if Tq * g > cpu_decode.MAX_ROWS:
        return None
    # C reads the pages the table names without bounds checks: refuse what would run off the cache
    NB = k_cache.shape[0]
    if tbl.shape[1] < width or bool(((tbl < 0) | (tbl >= NB)).any()):
        raise IndexError(f"block_table: a request's page id is outside the cache's {NB} pages, or the table has "
                         f"{tbl.shape[1]} columns where kv_lens need {width}; fix the block table")
    qt = qp.unflatten(2, (Hkv, g)).permute(0, 2, 1, 3, 4).reshape(Bg, Hkv, Tq * g, D)
    res = cpu_decode.attend(qt, kvl, k_cache, v_cache, tbl, scale, k_scales, v_scales)
    if res is None:
        return None
    o, l = res  # [Bg, Hkv, Tq * g, Dv], [Bg, Hkv, Tq * g]
    return (o.unflatten(2, (Tq, g)).permute(0, 2, 1, 3, 4).flatten(2, 3),
            l.unflatten(2, (Tq, g)).permute(0, 2, 1, 3).flatten(2, 3))


def _attend_group(qp: Tensor, kvl: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, scale: float,
                  v_from_k: bool, cd: torch.dtype, k_scales: Tensor | None = None,
                  v_scales: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Padded group: qp [Bg, Tq, Hq, D] (cd), kvl [Bg, Tq] int64 (0: padding),
    table [Bg, width] (only entries below each row's pages are valid)
    -> out [Bg, Tq, Hq, Dv] fp32, lse [Bg, Tq, Hq] fp32. A quantised cache comes with its
    scales as [NB, BS, Hkv, 1] views (`k_scales`, `v_scales`), read the way the pages are."""
    Bg, Tq, Hq, D = qp.shape
    BS, Hkv = k_cache.shape[1], k_cache.shape[2]
    Dv = v_cache.shape[3]
    Dw = D if v_from_k else max(D, Dv)  # head size the flash kernel sees (it needs Dqk == Dv)
    g = Hq // Hkv
    need = (kvl.amax(dim=1) + BS - 1) // BS  # [Bg] pages per request
    width = int(need.max())
    tbl = table[:, :width].long()
    tbl = torch.where(torch.arange(width)[None, :] < need[:, None], tbl, torch.zeros_like(tbl))  # unused -> page 0
    quant = k_scales is not None
    c_out = _attend_c(qp, kvl, k_cache, v_cache, tbl, width, scale,
                      *((k_scales[..., 0], v_scales[..., 0]) if quant else ()))  # type: ignore[index]
    if c_out is not None:
        return c_out
    # An fp8 cache is viewed and gathered as bytes (CPU index_select has no fp8 kernel).
    k_raw, v_raw = kv_quant.bytes_view(k_cache), kv_quant.bytes_view(v_cache)
    kview = _strided_view(k_raw, tbl, need)
    vview = None if kview is None or v_from_k else _strided_view(v_raw, tbl, need)
    in_place = kview is not None and (v_from_k or vview is not None)
    if quant:
        ksview = _strided_view(k_scales, tbl, need) if in_place else None
        vsview = _strided_view(v_scales, tbl, need) if in_place and not v_from_k else None  # type: ignore[arg-type]
        in_place = in_place and ksview is not None and (v_from_k or vsview is not None)
    elt = k_cache.element_size()
    if in_place and k_cache.dtype == cd:  # a view: no copy to keep small
        chunk = VIEW_CHUNK_TOKENS
    else:  # a gathered or converted chunk: a few MiB
        per_token = Bg * Hkv * (D + (0 if v_from_k else Dv)) * elt
        chunk = max(BS, (CHUNK_BYTES // max(per_token, 1)) // BS * BS)
    tq = max(1, min(Tq, ROWS_PER_TILE // max(Bg * g, 1)))
    out = torch.zeros(Bg, Tq, Hq, Dv, dtype=torch.float32)
    lse = torch.full((Bg, Tq, Hq), float("-inf"), dtype=torch.float32)
    n_tiles = (Tq + tq - 1) // tq
    kvl_pad = torch.nn.functional.pad(kvl, (0, n_tiles * tq - Tq)).view(Bg, n_tiles, tq)
    live = kvl_pad > 0
    big = torch.iinfo(torch.int64).max
    # lim[b, i]: request b's readable prefix in tile i (the largest kv_len of its rows there);
    # every slot at or past it may hold garbage (torch.empty caches, rolled-back drafts: NaN, inf).
    lim = kvl_pad.amax(dim=2)  # [Bg, n_tiles]
    bounds = torch.stack([kvl_pad.amax(dim=(0, 2)), torch.where(live, kvl_pad, big).amin(dim=(0, 2)),
                          torch.where(lim > 0, lim, big).amin(dim=0)]).tolist()
    for i in range(n_tiles):
        nmax, nmin, lim_min = bounds[0][i], bounds[1][i], bounds[2][i]
        if nmax <= 0:
            continue
        t0, t1 = i * tq, min((i + 1) * tq, Tq)
        rows = t1 - t0
        kv_t = kvl[:, t0:t1]
        # [Bg, rows, Hkv, g, D] -> [Bg, Hkv, rows * g, D]; zero-padded to Dw for a GQA Dv > D
        qt = qp[:, t0:t1].unflatten(2, (Hkv, g)).permute(0, 2, 1, 3, 4).reshape(Bg, Hkv, rows * g, D)
        if Dw > D:
            qt = torch.nn.functional.pad(qt, (0, Dw - D))
        # Keys below `clean` (whole pages) are seen by every live row: no mask, no garbage.
        # Past it a chunk is masked (a [Bg, rows * g, n] mask bounds its size when rows > 1).
        clean, end = nmin // BS * BS, (nmax + BS - 1) // BS * BS
        mstep = chunk if rows == 1 else max(BS, min(chunk, MASK_ELEMS // max(Bg * rows * g, 1)) // BS * BS)
        spans = [(c0, min(c0 + chunk, clean)) for c0 in range(0, clean, chunk)]
        spans += [(c0, min(c0 + mstep, end)) for c0 in range(clean, end, mstep)]
        lim_t = lim[:, i].tolist()
        acc = l_run = None
        bufs: dict[str, Tensor] = {}
        for c0, c1 in spans:
            n = c1 - c0
            if in_place:
                k = kview[:, c0:c1]
                v = k if v_from_k else vview[:, c0:c1]  # type: ignore[index]
            else:
                pages = tbl[:, c0 // BS:c1 // BS].reshape(-1)
                k = _gather(k_raw, pages, bufs, "k").view(Bg, n, Hkv, k_cache.shape[3])
                v = k if v_from_k else _gather(v_raw, pages, bufs, "v").view(Bg, n, Hkv, Dv)
            if quant:  # dequantise on load: codes (as stored) * the rows' scales, in fp32
                if in_place:
                    ks = ksview[:, c0:c1]  # type: ignore[index]
                    vs = ks if v_from_k else vsview[:, c0:c1]  # type: ignore[index]
                else:
                    ks = _gather(k_scales, pages, bufs, "ks").view(Bg, n, Hkv, 1)
                    vs = ks if v_from_k else _gather(v_scales, pages, bufs, "vs").view(Bg, n, Hkv, 1)  # type: ignore[arg-type]
                k = k.view(k_cache.dtype).to(cd) * ks
                v = k if v_from_k else v.view(v_cache.dtype).to(cd) * vs
            if k.dtype != cd:
                k = k.to(cd)
                v = k if v_from_k else v.to(cd)
            if Dw > Dv:
                v = k if v_from_k else torch.nn.functional.pad(v, (0, Dw - Dv))
            if Dw > D:
                k = torch.nn.functional.pad(k, (0, Dw - D))
            if c1 > lim_min:  # a request's prefix ends inside: each request reads exactly its keys
                o_c, l_c = _flash_per_request(qt, k, v, kv_t, lim_t, c0, c1, g, scale)
            else:
                o_c, l_c = _flash_chunk(qt, k, v, kv_t, c0, c0 + n > nmin, g, scale)
            if acc is None:
                acc, l_run = o_c.float(), l_c
            else:
                acc, l_run = _merge(acc, l_run, o_c, l_c)
        assert acc is not None and l_run is not None
        # [Bg, Hkv, rows * g, Dw] -> [Bg, rows, Hq, Dv]
        acc = torch.where(torch.isfinite(l_run)[..., None], acc, torch.zeros((), dtype=acc.dtype))
        out[:, t0:t1] = acc[..., :Dv].unflatten(2, (rows, g)).permute(0, 2, 1, 3, 4).flatten(2, 3)
        lse[:, t0:t1] = l_run.unflatten(2, (rows, g)).permute(0, 2, 1, 3).flatten(2, 3)
    return out, lse


def paged_attention_lse(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                        query_start_loc: Tensor, kv_lens: Tensor, scale: float, k_scale_cache: Tensor | None = None,
                        v_scale_cache: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`reference.paged_attention_with_lse`, computed as the module docstring says.

    q [T, Hq, D], caches [NB, BS, Hkv, D|Dv], block_table [B, nb], query_start_loc [B+1],
    kv_lens [T] -> out [T, Hq, Dv] (q dtype), lse [T, Hq] fp32.
    """
    T, Hq, D = q.shape
    Dv = v_cache.shape[3]
    out = torch.zeros(T, Hq, Dv, dtype=q.dtype, device=q.device)
    lse = torch.full((T, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    B = query_start_loc.shape[0] - 1
    if T == 0 or B <= 0 or k_cache.shape[0] == 0:
        return out, lse
    qsl = query_start_loc.long()
    req = request_index(query_start_loc, T).long()
    kvl = torch.where(req >= 0, kv_lens.long(), torch.zeros_like(req))
    q_lens = qsl[1:] - qsl[:-1]
    # Power-of-two class of each request's token count: one padded batch per class.
    cls = torch.ceil(torch.log2(q_lens.clamp(min=1).double())).long()
    classes = torch.unique(cls[q_lens > 0]).tolist()
    kv_quant.check_pair(k_cache, k_scale_cache, "k_cache")
    kv_quant.check_pair(v_cache, v_scale_cache, "v_cache")
    v_from_k = _v_is_k_prefix(k_cache, v_cache)
    quant = k_scale_cache is not None
    # The scales as [NB, BS, Hkv, 1]: paged like the cache, so the same views and gathers read them.
    k_scales = kv_quant.scale_view(k_cache, k_scale_cache).unsqueeze(-1) if quant else None
    v_scales = kv_quant.scale_view(v_cache, v_scale_cache).unsqueeze(-1) if quant else None  # type: ignore[arg-type]
    cd = torch.promote_types(q.dtype, torch.float32) if quant else _compute_dtype(q, k_cache)
    for c in classes:
        members = torch.nonzero((cls == c) & (q_lens > 0)).flatten()  # [Bg] requests of this class
        Bg = members.shape[0]
        Tq = int(q_lens[members].max())
        local = torch.arange(Tq)[None, :]  # [1, Tq]
        valid = local < q_lens[members][:, None]  # [Bg, Tq]
        tok = torch.where(valid, qsl[members][:, None] + local, torch.zeros_like(local))  # [Bg, Tq] token ids
        qp = q[tok.flatten()].view(Bg, Tq, Hq, D).to(cd)
        kv_g = torch.where(valid, kvl[tok], torch.zeros_like(tok))
        if int(kv_g.max()) <= 0:
            continue
        o_g, l_g = _attend_group(qp, kv_g, k_cache, v_cache, block_table[members], scale, v_from_k, cd, k_scales,
                                 v_scales)
        sel = valid.flatten()
        ids = tok.flatten()[sel]
        out[ids] = o_g.flatten(0, 1)[sel].to(q.dtype)
        lse[ids] = l_g.flatten(0, 1)[sel]
    return out, lse


def mla_attention_lse(q_nope: Tensor, q_pe: Tensor, kv_cache: Tensor, block_table: Tensor,
                      query_start_loc: Tensor, kv_lens: Tensor, scale: float,
                      kv_scale_cache: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """`reference.mla_attention_with_lse` through `paged_attention_lse`: keys are the cached
    [c; k_pe], values the first L columns, read from the same pages once (a quantised latent:
    with its per-token scales [NB, BS, 1])."""
    L = q_nope.shape[-1]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, L+R]
    return paged_attention_lse(q, kv_cache.unsqueeze(2), kv_cache[..., :L].unsqueeze(2), block_table,
                               query_start_loc, kv_lens, scale, kv_scale_cache, kv_scale_cache)
