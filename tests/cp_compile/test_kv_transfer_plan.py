"""The transfer plan against brute-force ownership, in one process.

Brute force: a request's token p, KV head h holds a unique value. P rank caches are
filled, and the D rank caches expected, by dealing each virtual block's tokens out
in chunks of `interleave` to the cp ranks round-robin, each rank filling its page in
order (the §5 rule simulated, not its formula). The plan's byte descriptors are then
executed by memmove between the tensors of this process, and every D rank must equal
the brute-force expectation, with every destination byte written exactly once, and
the bytes moved must equal `expected_bytes`.
"""

from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
import torch

from cp_compile.serving.kv_transfer.layout import KVGeometry, KVLayout, check_compatible
from cp_compile.serving.kv_transfer.plan import expected_bytes, expected_rank_bytes, plan_rank
from cp_compile.serving.kv_transfer.reads import STAGE_BELOW, group_runs, layer_reads, same_rows
from cp_compile.serving.kv_transfer.regions import CacheRegion, check_in_regions, regions_of
from cp_compile.base.errors import ConfigError
from cp_compile.runtime.kv_cache import tp_kv_head_ids

HEAD, VHEAD, LATENT, INDEX = 3, 2, 5, 4


def _deal(layout: KVLayout, n: int, blocks: list[int]) -> dict[int, tuple[int, int]]:
    """position -> (cp rank, slot) by simulation of the interleaved deal."""
    N, I, bs = layout.context_parallel_size, layout.cp_kv_cache_interleave_size, layout.block_size
    out = {}
    for p in range(n):
        vb, j = divmod(p, bs * N)
        counts = [0] * N
        for q in range(j + 1):  # deal tokens 0..j of this virtual block
            r = (q // I) % N
            if q == j:
                out[p] = (r, blocks[vb] * bs + counts[r])
            counts[r] += 1
    return out


def _value(p: int, h: int, which: int) -> torch.Tensor:  # unique per (token, head, tensor)
    return torch.arange(8, dtype=torch.float32) + 1000.0 * (p + 1) + 10.0 * h + 0.1 * which


def _code(p: int, h: int, which: int) -> torch.Tensor:  # int8 "codes" of a quantised cache, never 0
    return ((torch.arange(8) + 7 * p + 3 * h + 5 * which) % 125 + 1).to(torch.int8)


def _caches(geo: KVGeometry, layout: KVLayout, rank: int, num_blocks: int, n: int, blocks: list[int] | None):
    """A rank's caches; filled with the request's values when `blocks` is given (P side).
    A quantised geometry: int8 pages and, beside them, fp32 scales per (page, offset, head)."""
    heads = geo.kv_heads_of(layout, rank)
    bs = layout.block_size
    dt = torch.int8 if geo.quantized else torch.float32
    if geo.kind == "gqa":
        layers = [(torch.zeros(num_blocks, bs, len(heads), HEAD, dtype=dt),
                   torch.zeros(num_blocks, bs, len(heads), VHEAD, dtype=dt))]
        if geo.quantized:
            layers = [layers[0] + (torch.zeros(num_blocks, bs, len(heads)), torch.zeros(num_blocks, bs, len(heads)))]
    else:
        layers = [(torch.zeros(num_blocks, bs, LATENT, dtype=dt),)]
        if geo.quantized:
            layers = [layers[0] + (torch.zeros(num_blocks, bs, 1),)]
    index = [torch.zeros(num_blocks, layout.virtual_block_size, INDEX)] if geo.kind == "sfa" else []
    if blocks is not None:
        fill(geo, layout, rank, layers, index, n, blocks)
    return layers, index


def fill(geo, layout, rank, layers, index, n, blocks):
    me = layout.coords(rank).cp_rank
    heads = geo.kv_heads_of(layout, rank)
    for p, (owner, slot) in _deal(layout, n, blocks).items():
        if owner == me:
            page, off = divmod(slot, layout.block_size)
            val = _code if geo.quantized else _value
            if geo.kind == "gqa":
                for i, h in enumerate(heads):
                    layers[0][0][page, off, i] = val(p, h, 0)[:HEAD]
                    layers[0][1][page, off, i] = val(p, h, 1)[:VHEAD]
                    if geo.quantized:  # the scales: unique per (token, head, tensor)
                        layers[0][2][page, off, i] = _value(p, h, 4)[0]
                        layers[0][3][page, off, i] = _value(p, h, 5)[0]
            else:
                layers[0][0][page, off] = val(p, 0, 2)[:LATENT]
                if geo.quantized:
                    layers[0][1][page, off, 0] = _value(p, 0, 6)[0]
    for p in range(n):
        vb, j = divmod(p, layout.virtual_block_size)
        if index:
            index[0][blocks[vb], j] = _value(p, 0, 3)[:INDEX]


def _geometry(kind: str, kv_heads: int, kv_cache_dtype: str = "auto") -> KVGeometry:
    q = dict(dtype="torch.int8", kv_cache_dtype=kv_cache_dtype) if kv_cache_dtype != "auto" else {}
    if q and kind == "sfa":  # int8 latent codes, the indexer keys in the model's dtype (decision 69)
        q["index_dtype"] = "torch.float32"
    if kind == "gqa":
        return KVGeometry("gqa", 1, num_kv_heads=kv_heads, head_dim=HEAD, v_head_dim=VHEAD, **q)
    return KVGeometry(kind, 1, latent_dim=LATENT, index_dim=INDEX if kind == "sfa" else 0, **q)


def _blocks(layout: KVLayout, n: int, offset: int) -> list[int]:
    need = -(-n // layout.virtual_block_size)
    return [offset + 2 * i for i in range(need)][::-1]  # non-contiguous, descending: no accidental identity


def _flat(caches) -> list[torch.Tensor]:
    """A rank's cache tensors in `regions_of` order."""
    layers, index = caches
    return list(itertools.chain(*layers)) + index


def transfer(src: KVLayout, dst: KVLayout, geo: KVGeometry, n: int, coalesce: bool = True,
             stage_below: int = STAGE_BELOW):
    """Plan, execute by memmove (staged rows: into a staging buffer, then its scatter),
    check against brute force. Returns (bytes moved, runs, descriptors)."""
    nb = 2 * (-(-n // min(src.virtual_block_size, dst.virtual_block_size))) + 4
    sb, db = _blocks(src, n, 1), _blocks(dst, n, 0)
    p_caches = {r: _caches(geo, src, r, nb, n, sb) for r in range(src.world_size)}
    p_regions = {r: regions_of(*p_caches[r], geo.kind, quantized=geo.quantized) for r in p_caches}
    moved = runs = ndesc = 0
    for d in range(dst.world_size):
        got = _caches(geo, dst, d, nb, n, None)
        want = _caches(geo, dst, d, nb, n, db)
        # per-element write counts (fp32 tensors of the caches' shapes)
        written = ([tuple(torch.zeros(t.shape) for t in layer) for layer in got[0]], [torch.zeros(t.shape)
                                                                                      for t in got[1]])
        plan = plan_rank(src, dst, geo, n, sb, db, d)
        assert set(plan.dst_blocks) == set(db)
        assert plan.bytes(geo) == expected_rank_bytes(geo, dst, n, d)
        local = regions_of(*got, geo.kind, quantized=geo.quantized)
        runs += len(plan.runs)
        # as the connector does: the runs grouped once (layer 0's row sizes), reused for every layer
        groups = group_runs(plan, local, p_regions, 0) if coalesce and same_rows(local, p_regions) else None
        for layer in range(geo.num_layers):
            reads = layer_reads(plan, local, p_regions, layer, coalesce=coalesce, stage_below=stage_below,
                                groups=groups)
            staging = torch.zeros(max(reads.staging_bytes, 1), dtype=torch.uint8)
            stage_region = CacheRegion("staging", -1, staging.data_ptr(), staging.numel(), 1, 1)
            for s, (loc, rem) in reads.bind(staging.data_ptr(), 0).items():
                check_in_regions(loc, local + (stage_region,), "decode")
                check_in_regions(rem, p_regions[s], "prefill")
                ndesc += len(loc)
                for (la, ln, _), (ra, rn, _) in zip(loc.tolist(), rem.tolist()):
                    assert ln == rn
                    ctypes.memmove(la, ra, ln)
                    moved += ln
                    if stage_region.addr <= la < stage_region.addr + stage_region.nbytes:
                        continue  # counted when scattered
                    # count writes: local address -> same offset in the counts tensors
                    reg = next(i for i, r in enumerate(local) if r.addr <= la < r.addr + r.nbytes)
                    off, e = la - local[reg].addr, _flat(got)[reg].element_size()
                    _flat(written)[reg].view(-1)[off // e: (off + ln) // e] += 1
            reads.scatter(_flat(got), staging)
            for sc in reads.scatters:  # index_add_: a slot scattered twice counts twice
                rows = _flat(written)[sc.region].view(-1, sc.row_bytes // _flat(got)[sc.region].element_size())
                idx = torch.from_numpy(sc.dst_slots)
                rows.index_add_(0, idx, torch.ones(len(idx), rows.shape[1]))
        for g, w, c in zip(_flat(got), _flat(want), _flat(written)):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
            assert int(c.max()) <= 1, "a destination element was written twice"
            assert bool(((c == 1) == (w != 0)).all()), "written elements are exactly the owned ones"
    return moved, runs, ndesc


L = KVLayout  # (tp, pcp, dcp, interleave, block_size)
CASES = [
    # the layouts
    ("gqa", 1, L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8)),  # P(tp2,dcp2) -> D(tp2,dcp1), block sizes differ
    ("gqa", 1, L(1, 2, 1, 1, 4), L(2, 1, 2, 1, 4)),  # P(tp1,pcp2) -> D(tp2,dcp2)
    ("gqa", 1, L(2, 1, 1, 4, 4), L(2, 1, 2, 4, 4)),  # P(tp2,dcp1) -> D(tp2,dcp2), block interleave
    ("gqa", 1, L(2, 1, 2, 1, 4), L(2, 1, 2, 4, 4)),  # interleave 1 -> block_size
    ("gqa", 1, L(2, 1, 2, 8, 8), L(2, 1, 2, 1, 4)),  # block_size -> interleave 1, block sizes differ
    # KV heads split differently on the two sides (TP head segments)
    ("gqa", 2, L(2, 1, 1, 1, 4), L(1, 1, 1, 1, 8)),  # P one head per rank -> D both heads
    ("gqa", 2, L(1, 2, 1, 2, 4), L(2, 1, 1, 1, 4)),  # P both heads, PCP -> D one head per rank
    ("gqa", 2, L(4, 1, 2, 1, 4), L(1, 1, 1, 2, 8)),  # P tp4 dcp2 (each head on 2 ranks) -> D both heads
    ("gqa", 1, L(2, 2, 2, 2, 4), L(4, 1, 4, 1, 2)),  # PCP x DCP -> wider DCP
    ("mla", 0, L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8)),
    ("mla", 0, L(1, 2, 1, 4, 4), L(2, 1, 2, 4, 4)),
    ("mla", 0, L(4, 1, 4, 2, 4), L(2, 1, 2, 8, 8)),
    ("sfa", 0, L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8)),
    ("sfa", 0, L(2, 1, 1, 4, 4), L(2, 1, 2, 1, 4)),
]


@pytest.mark.parametrize("kind,kv_heads,src,dst", CASES, ids=[f"{c[0]}-{c[2].describe()}->{c[3].describe()}"
                                                              .replace(" ", ",") for c in CASES])
@pytest.mark.parametrize("n", [1, 7, 37])
def test_plan_matches_brute_force(kind, kv_heads, src, dst, n):
    geo = _geometry(kind, kv_heads)
    moved, _, _ = transfer(src, dst, geo, n)
    assert moved == expected_bytes(geo, dst, n)


def test_block_interleave_moves_whole_blocks():
    """interleave == block_size, same block size and cp size: one run per block (a whole
    page), against one run per interleave chunk with token interleave."""
    geo = _geometry("mla", 0)
    n = 64  # 4 virtual blocks of 16 at cp 2, block 8
    sb, db = [5, 1, 3, 7], [2, 6, 0, 4]  # scattered pages: runs cannot span blocks
    same = L(2, 1, 2, 8, 8)
    p = plan_rank(same, same, geo, n, sb, db, 0)
    assert [(r.src_slot, r.dst_slot, r.num_tokens) for r in p.runs] == [(b * 8, c * 8, 8) for b, c in zip(sb, db)]
    tok = L(2, 1, 2, 1, 8)
    q = plan_rank(tok, tok, geo, n, sb, db, 0)
    assert len(q.runs) == 4 and all(r.num_tokens == 8 for r in q.runs)  # same layout: pages align too
    mixed = plan_rank(tok, same, geo, n, sb, db, 0)
    assert len(mixed.runs) == n // 2 and all(r.num_tokens == 1 for r in mixed.runs)  # token path


@pytest.mark.parametrize("stage_below", [STAGE_BELOW, 1])
def test_coalesced_reads_equal_uncoalesced(stage_below):
    """Token interleave P(tp2,dcp2,I1) -> D(tp2,dcp1): every run is one token; coalesced,
    each P rank's tokens are one descriptor per cache tensor (staged, then scattered),
    the same bytes, exact. stage_below 1: nothing staged, runs merged where both sides
    are contiguous only (here none are: as many descriptors as runs)."""
    geo = _geometry("gqa", 1)
    src, dst, n = L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8), 37
    moved0, runs, before = transfer(src, dst, geo, n, coalesce=False)
    moved1, _, after = transfer(src, dst, geo, n, coalesce=True, stage_below=stage_below)
    assert moved0 == moved1 == expected_bytes(geo, dst, n)
    assert before == 2 * runs  # K and V: one descriptor per run
    if stage_below == 1:
        assert after == before
    else:  # per D rank, P rank, K / V: one per P page (the test's P pages are not adjacent: 5 pages)
        assert after == dst.world_size * 2 * 2 * -(-n // src.virtual_block_size), (before, after)


def test_block_interleave_stays_direct():
    """interleave == block_size on both sides: whole blocks, never staged (no extra copy)."""
    geo = _geometry("mla", 0)
    src, dst, n = L(2, 1, 2, 4, 4), L(2, 1, 2, 4, 4), 37
    sb, db = _blocks(src, n, 1), _blocks(dst, n, 0)
    p_regions = {r: regions_of(*_caches(geo, src, r, 30, n, sb), geo.kind) for r in range(2)}
    local = regions_of(*_caches(geo, dst, 0, 30, n, None), geo.kind)
    reads = layer_reads(plan_rank(src, dst, geo, n, sb, db, 0), local, p_regions, 0, stage_below=16)
    assert reads.staging_bytes == 0 and not reads.scatters


def test_mutated_scatter_is_caught():
    """The brute-force check fails when the staged rows land one slot off."""
    import cp_compile.serving.kv_transfer.reads as reads_mod

    real = reads_mod.Scatter

    def shifted(region, offset, row_bytes, dst_slots):
        return real(region, offset, row_bytes, np.roll(dst_slots, 1))

    reads_mod.Scatter = shifted
    try:
        with pytest.raises(AssertionError):
            transfer(L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8), _geometry("mla", 0), 9)
    finally:
        reads_mod.Scatter = real


def test_no_decode_rank_reads_the_whole_request():
    """Each D rank of a DCP instance reads 1/dcp of the tokens, from the P ranks that hold them."""
    geo = _geometry("mla", 0)
    src, dst, n = L(2, 1, 2, 1, 4), L(2, 1, 2, 1, 4), 40
    for d in range(2):
        plan = plan_rank(src, dst, geo, n, list(range(5)), list(range(5)), d)
        assert sum(r.num_tokens for r in plan.runs) == n // 2
        assert plan.src_ranks() == (d,)  # the P rank of the same cp rank, not a gathering rank


def test_replicas_spread_over_sources():
    """D's TP replicas of a cp rank read from different P replicas."""
    geo = _geometry("mla", 0)
    src, dst = L(2, 1, 1, 1, 4), L(2, 1, 1, 1, 4)  # both ranks hold everything on both sides
    assert [plan_rank(src, dst, geo, 9, [0, 1, 2], [0, 1, 2], d).src_ranks() for d in range(2)] == [(0,), (1,)]


def test_mutated_plan_is_caught():
    """The brute-force check fails on a broken plan: swap two runs' sources."""
    import cp_compile.serving.kv_transfer.plan as plan_mod

    real = plan_mod._owner
    plan_mod._owner = lambda pos, layout: (real(pos, layout) + 1) % layout.context_parallel_size
    try:
        with pytest.raises(AssertionError):
            transfer(L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8), _geometry("mla", 0), 9)
    finally:
        plan_mod._owner = real


@pytest.mark.parametrize("field,value", [("num_layers", 3), ("num_kv_heads", 4), ("head_dim", 8),
                                         ("v_head_dim", 8), ("dtype", "torch.bfloat16"), ("kind", "mla"),
                                         ("kv_cache_dtype", "int8")])
def test_geometry_mismatch_refused(field, value):
    p = _geometry("gqa", 2)
    d = KVGeometry(**{**p.__dict__, field: value})
    with pytest.raises(ConfigError, match=rf"{field}: prefill .*, decode {value!r}".replace("(", r"\(")):
        check_compatible(p, d)
    check_compatible(p, p)


def test_bad_block_tables_refused():
    geo = _geometry("mla", 0)
    lay = L(2, 1, 2, 1, 4)
    with pytest.raises(ValueError, match="prefill block table has 1 blocks but 9 tokens need 2"):
        plan_rank(lay, lay, geo, 9, [0], [0, 1], 0)
    with pytest.raises(ValueError, match="decode block table .* negative"):
        plan_rank(lay, lay, geo, 9, [0, 1], [0, -1], 0)


def test_head_ids_match_kv_cache():
    geo = _geometry("gqa", 4)
    for tp in (1, 2, 4, 8):
        lay = L(tp, 1, 1, 1, 4)
        assert [geo.kv_heads_of(lay, r) for r in range(tp)] == [tp_kv_head_ids(4, tp, r) for r in range(tp)]


def _two_layers(geo: KVGeometry, layout: KVLayout, rank: int, nb: int, n: int, blocks):
    """Regions of a rank with two layers (the second a copy of the first's shapes, its own memory)."""
    layers, index = _caches(geo, layout, rank, nb, n, blocks)
    layers = layers + [tuple(t.clone() for t in layers[0])]
    index = index + [t.clone() for t in index]
    return regions_of(layers, index, geo.kind), (layers, index)


@pytest.mark.parametrize("kind,kv_heads,src,dst", CASES, ids=[f"{c[0]}-{c[2].describe()}->{c[3].describe()}"
                                                              .replace(" ", ",") for c in CASES])
def test_runs_grouped_once_serve_every_layer(kind, kv_heads, src, dst):
    """The connector groups a request's runs once (`group_runs` at layer 0) and reuses them
    for every layer: each layer's descriptors, staging and scatters equal those built for
    that layer alone."""
    geo, n = _geometry(kind, kv_heads), 37
    nb = 2 * (-(-n // min(src.virtual_block_size, dst.virtual_block_size))) + 4
    sb, db = _blocks(src, n, 1), _blocks(dst, n, 0)
    keep = []  # the tensors must outlive their regions' addresses
    p_regions = {}
    for r in range(src.world_size):
        p_regions[r], t = _two_layers(geo, src, r, nb, n, sb)
        keep.append(t)
    for d in range(dst.world_size):
        local, t = _two_layers(geo, dst, d, nb, n, None)
        keep.append(t)
        plan = plan_rank(src, dst, geo, n, sb, db, d)
        assert same_rows(local, p_regions)
        groups = group_runs(plan, local, p_regions, 0)
        for layer in (0, 1):
            a, b = layer_reads(plan, local, p_regions, layer, groups=groups), layer_reads(plan, local, p_regions, layer)
            assert a.per_src.keys() == b.per_src.keys() and a.staging_bytes == b.staging_bytes
            for s in a.per_src:
                for x, y in zip(a.per_src[s] + (a.staged[s],), b.per_src[s] + (b.staged[s],)):
                    np.testing.assert_array_equal(x, y)
            assert [(c.region, c.offset, c.row_bytes) for c in a.scatters] == \
                [(c.region, c.offset, c.row_bytes) for c in b.scatters]
            for c, e in zip(a.scatters, b.scatters):
                np.testing.assert_array_equal(c.dst_slots, e.dst_slots)



# A quantised cache (issue 39, decisions 65 and 67): int8 pages and their fp32 scales per
# (page, offset, KV head) move together, between layouts, head subsets included.
QUANT_CASES = [
    ("gqa", 1, L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8)),  # token interleave -> dcp 1: staged reads, scattered
    ("gqa", 2, L(2, 1, 1, 1, 4), L(1, 1, 1, 1, 8)),  # P one head per rank -> D both heads: head segments
    ("gqa", 2, L(4, 1, 2, 1, 4), L(1, 1, 1, 2, 8)),
    ("gqa", 1, L(2, 1, 1, 4, 4), L(2, 1, 2, 4, 4)),  # whole blocks
    ("mla", 0, L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8)),
    ("mla", 0, L(4, 1, 4, 2, 4), L(2, 1, 2, 8, 8)),
    # SFA: int8 latent + its scales sharded, the replicated indexer's fp32 keys on every D rank
    ("sfa", 0, L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8)),
    ("sfa", 0, L(2, 1, 1, 4, 4), L(2, 1, 2, 1, 4)),
]


@pytest.mark.parametrize("kind,kv_heads,src,dst", QUANT_CASES,
                         ids=[f"{c[0]}-{c[2].describe()}->{c[3].describe()}".replace(" ", ",") for c in QUANT_CASES])
@pytest.mark.parametrize("coalesce", [True, False])
def test_quantised_pages_and_scales_match_brute_force(kind, kv_heads, src, dst, coalesce):
    """Every D rank's codes and scales equal the brute-force deal, each written once, and the
    bytes moved equal the formula with the scales counted (4 bytes per token and KV head and
    page tensor)."""
    geo = _geometry(kind, kv_heads, "int8")
    for n in (7, 37):
        moved, _, _ = transfer(src, dst, geo, n, coalesce=coalesce)
        assert moved == expected_bytes(geo, dst, n)
        plain = _geometry(kind, kv_heads)
        copies = dst.tensor_parallel_size // dst.decode_context_parallel_size
        heads = len(geo.kv_heads_of(dst, 0)) if kind == "gqa" else 1
        scales = n * copies * heads * 4 * (2 if kind == "gqa" else 1)
        index = n * dst.world_size * INDEX * 4 if kind == "sfa" else 0  # fp32 indexer keys, unquantised
        # int8 codes: a quarter of fp32's bytes; the scales on top; SFA's indexer keys as they were
        assert moved == (expected_bytes(plain, dst, n) - index) // 4 + scales + index


def test_quantised_transfer_without_the_scale_regions_is_caught():
    """The check fails on a broken transfer: the scale tensors left out of the regions (the
    codes move, the scales stay zero on D)."""
    real = globals()["regions_of"]

    def codes_only(layers, replicated, kind, quantized=None):
        return real([tuple(layer[: len(layer) // 2]) for layer in layers], replicated, kind, quantized=False)

    globals()["regions_of"] = codes_only
    try:
        with pytest.raises(AssertionError):
            transfer(L(2, 1, 2, 1, 4), L(2, 1, 1, 1, 8), _geometry("gqa", 1, "int8"), 9)
    finally:
        globals()["regions_of"] = real


def test_kv_cache_dtype_mismatch_refused_with_the_fix():
    p, d = _geometry("gqa", 2, "fp8_e4m3"), _geometry("gqa", 2, "int8")
    for a, b in ((p, d), (p, _geometry("gqa", 2)), (_geometry("mla", 0), _geometry("mla", 0, "int8"))):
        with pytest.raises(ConfigError) as err:
            check_compatible(a, b)
        msg = str(err.value)
        assert f"kv_cache_dtype: prefill {a.kv_cache_dtype!r}, decode {b.kv_cache_dtype!r}" in msg, msg
        assert f"Fix: start the decode instance with CPConfig(kv_cache_dtype={a.kv_cache_dtype!r})" in msg, msg
    check_compatible(p, p)


def test_quantised_layer_of_the_wrong_length_refused():
    k = torch.zeros(2, 4, 1, HEAD, dtype=torch.int8)
    with pytest.raises(ValueError, match=r"layer 0 has 2 cache tensors, a quantised gqa cache has 4 "
                                         r"\(k, v, k_scale, v_scale\)"):
        regions_of([(k, k)], [], "gqa", quantized=True)
    with pytest.raises(ValueError, match="k_scale cache of layer 0 is torch.float16"):
        regions_of([(k, k, torch.zeros(2, 4, 1, dtype=torch.float16), torch.zeros(2, 4, 1))], [], "gqa")
