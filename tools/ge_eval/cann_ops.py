"""References of the CANN fused ops the converters emit, from CANN's operator pages.

Sources (hicann/ops-transformer, the CANN ops-transformer repository; docs/torchair.md
tabulates which attribute rests on which page):
- FIA: attention/fused_infer_attention_score/docs/ascendir_FusedInferAttentionScore.md
  (the Ascend IR and its attributes), aclnnFusedInferAttentionScoreV2_en.md and
  V4_en.md (layouts, paged attention, sparse modes, softmaxLse);
- AttentionUpdate: attention/attention_update/docs/aclnnAttentionUpdate_en.md;
- ScatterPaKvCache: attention/scatter_pa_kv_cache/docs/aclnnScatterPaKvCache_en.md and
  the Ascend IR (REG_OP) text;
- LightningIndexer: attention/lightning_indexer/docs/aclnnLightningIndexer_en.md;
- SparseFlashAttention: attention/sparse_flash_attention/docs/aclnnSparseFlashAttention_en.md;
- QuantBatchMatmulV3: the Ascend IR (REG_OP) comment of ops-nn's matmul protos (the
  x1 / x2 / scale / bias / out dtype table).

A documented precondition the graph breaks raises `GEEvalError`; an undocumented case
the values depend on is computed as the reference (ops/paged/reference.py) does and recorded
with `Findings.assume`; a documented NPU tiling limit the small CI shapes do not meet
(block sizes, head dims) is recorded with `Findings.note` and does not change values.

`VARIANTS`: undocumented behaviours with more than one plausible reading. The check
evaluates every graph under each reading; a graph that is right under one only is
reported as depending on it.
"""

from __future__ import annotations

import torch

from tools.ge_eval.evaluator import Ctx, GEEvalError, _ints, ge_dtype, op

# FIA's LSE of a row that sees no key: CANN says "when softmaxLseFlag is True, data
# that is inf is invalid" (V4 page) and nothing more. -inf is the reference's value.
VARIANTS = {"fia_empty_lse": ("-inf", "+inf")}
MAX_INT64 = (1 << 63) - 1


def _causal_mask_ok(mask: torch.Tensor) -> bool:
    """sparse_mode 2/3/4 take the compressed 2048 x 2048 mask: 1 (masked) above the diagonal."""
    if tuple(mask.shape[-2:]) != (2048, 2048) or mask.dim() not in (2, 3, 4):
        return False
    ref = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)
    return bool((mask.reshape(-1, 2048, 2048).bool() == ref).all())


def _attend(q, k, v, visible, scale):
    """q [S1, H, D], k/v [S2, Hkv, D*], visible [S1, S2] bool -> out [S1, H, Dv] fp32, lse [S1, H] fp32.
    Consecutive query heads share a kv head (h -> h // (H / Hkv))."""
    H, Hkv = q.shape[1], k.shape[1]
    g = H // Hkv
    kk = k.float().repeat_interleave(g, dim=1)  # [S2, H, D]
    vv = v.float().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), kk) * scale  # [H, S1, S2]
    s = s.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [H, S1]
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))[..., None])
    p = torch.where(visible[None], p, torch.zeros_like(p))
    out = torch.einsum("hqk,khd->qhd", p, vv)
    return out, lse.transpose(0, 1)


def _pages(cache, table_row, n, ctx, what):
    """The first n rows of a request's paged cache [NB, BS, ...] -> [n, ...]."""
    NB, BS = cache.shape[0], cache.shape[1]
    nblk = -(-n // BS)
    if nblk > table_row.numel():
        raise ctx.fail(f"{what}: {n} keys need {nblk} blocks, block_table row has {table_row.numel()} "
                       "(documented: the second dim must be >= maxBlockNumPerSeq)")
    ids = table_row[:nblk].long()
    if nblk and (int(ids.min()) < 0 or int(ids.max()) >= NB):
        raise ctx.fail(f"{what}: block id out of [0, {NB}) in {ids.tolist()} (documented: the user must "
                       "ensure valid block ids)")
    return cache[ids].reshape(nblk * BS, *cache.shape[2:])[:n]


def _lengths(t, B, ctx, what):
    vals = _ints(t)
    if len(vals) == 1 and B > 1:
        vals = vals * B  # documented: a single length applies to every batch
    if len(vals) < B:
        raise ctx.fail(f"{what} has {len(vals)} entries for B = {B} (documented: 1 or >= B)")
    _non_negative(vals[:B], ctx, what)
    return vals[:B]


def _non_negative(vals: list[int], ctx: Ctx, what: str) -> None:
    """A negative length is a wrong graph, not a case to evaluate (torch.arange of it
    would raise an error that names no op): refused with the op, the batch and the value."""
    bad = [(b, v) for b, v in enumerate(vals) if v < 0]
    if bad:
        raise ctx.fail(f"{what}: negative length {bad[0][1]} at batch {bad[0][0]} (all: {vals}; "
                       "a length counts tokens)")


def _within(vals: list[int], capacity: int, ctx: Ctx, what: str) -> None:
    """Each length in [0, capacity] (capacity: the keys the block-table row can hold)."""
    _non_negative(vals, ctx, what)
    bad = [(b, v) for b, v in enumerate(vals) if v > capacity]
    if bad:
        raise ctx.fail(f"{what}: length {bad[0][1]} at batch {bad[0][0]} is past the block table's "
                       f"{capacity} keys (all: {vals}; documented: the table must hold the sequence)")


# FIA's per-token antiquant modes whose scales page attention manages. Source: torch_npu's
# npu_fused_infer_attention_score page (Ascend/op-plugin docs/context/
# torch_npu-npu_fused_infer_attention_score.md, commit 0adf450), "kv伪量化参数分离" under
# "当Q_S等于1时": mode 4 "per-token叠加使用page attention模式管理scale/offset", scales
# (blocknum, blocksize); mode 5 "per-token叠加per head并使用page attention模式管理scale/offset",
# scales (blocknum, N, blocksize); both fp32, key / value int8 only; key and value modes equal
# (apart from the 0 / 1 pair), both scales given or neither; key_antiquant_mode takes 0-5
# only when Q_S = 1. Offsets absent = symmetric ("对称量化模式下，antiquant_offset可以为空").
# With page attention at Q_S = 1 the key / value may be int8 and block_size must be
# 32-aligned for int8 ("key、value输入类型为int8时需要32对齐").
PAGED_ANTIQUANT_MODES = {4: "per-token, page-managed (blocknum, blocksize)",
                         5: "per-token per-head, page-managed (blocknum, N, blocksize)"}


def _antiquant_paged(ctx: Ctx, n: dict, a: dict, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     bt) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 paged key / value with page-managed per-token scales -> the dequantised fp32 pages
    (code * scale per block, offset and kv head), which the attention below reads as any
    paged cache. Anything else with int8 pages or antiquant scales is refused."""
    ks, vs = n.get("key_antiquant_scale"), n.get("value_antiquant_scale")
    kmode, vmode = int(a.get("key_antiquant_mode", 0)), int(a.get("value_antiquant_mode", 0))
    if ks is None or vs is None:
        raise ctx.fail(f"int8 key / value ({key.dtype}, {value.dtype}) with key_antiquant_scale "
                       f"{'given' if ks is not None else 'absent'}, value_antiquant_scale "
                       f"{'given' if vs is not None else 'absent'}: the reference implements int8 pages only with "
                       "both page-managed antiquant scales (documented: both or neither)")
    if kmode != vmode:
        raise ctx.fail(f"key_antiquant_mode {kmode} != value_antiquant_mode {vmode} (documented: equal, but for "
                       "key 0 / value 1)")
    if kmode not in PAGED_ANTIQUANT_MODES:
        raise ctx.fail(f"key_antiquant_mode {kmode} not implemented (4, 5: per-token scales managed by page "
                       "attention)")
    if key.dtype != torch.int8 or value.dtype != torch.int8:
        raise ctx.fail(f"antiquant mode {kmode} with key {key.dtype}, value {value.dtype} (documented: int8 only)")
    if bt is None or key.dim() != 3:
        raise ctx.fail(f"antiquant mode {kmode} ({PAGED_ANTIQUANT_MODES[kmode]}) without a paged [blocks, "
                       "block_size, H] key and a block_table")
    if a.get("input_layout", "BSH") != "BSND" or q.dim() != 4 or q.shape[1] != 1:
        raise ctx.fail(f"antiquant mode {kmode} with query {tuple(q.shape)} layout {a.get('input_layout')}: "
                       "modes 2-5 are documented for Q_S = 1 only (implemented: BSND, S = 1)")
    NB, BS, Hk = key.shape
    H = int(a["num_heads"])
    Hkv = int(a.get("num_key_value_heads", 0)) or H
    want = (NB, BS) if kmode == 4 else (NB, Hkv, BS)
    for what, s in (("key_antiquant_scale", ks), ("value_antiquant_scale", vs)):
        if s.dtype != torch.float32 or tuple(s.shape) != want:
            raise ctx.fail(f"{what} {tuple(s.shape)} {s.dtype}: mode {kmode} takes {want} float32 (documented "
                           f"{PAGED_ANTIQUANT_MODES[kmode]})")
    if BS % 32:
        ctx.findings.note(f"FIA paged attention with int8 key / value: block_size {BS} is not 32-aligned (CANN "
                          "requires it; CI shapes only)")
    if q.dtype != torch.float16:
        ctx.findings.assume(f"FusedInferAttentionScore: a {q.dtype} query with int8 key / value in antiquant mode "
                            f"{kmode} (the page restricts the query dtype only for the key per-channel / value "
                            "per-token pair)")
    ctx.findings.assume("FusedInferAttentionScore antiquant: key / value = code * scale (no offset given: symmetric), "
                        "in fp32 before the dot products (the dequantised operand's precision is undocumented)")

    def dequant(cache: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        rows = cache.reshape(NB, BS, Hkv, cache.shape[2] // Hkv).float()  # [NB, BS, Hkv, D]
        per = s[:, :, None] if kmode == 4 else s.permute(0, 2, 1)  # [NB, BS, 1 | Hkv]
        return (rows * per[..., None]).reshape(NB, BS, cache.shape[2])

    return dequant(key, ks), dequant(value, vs)


@op("FusedInferAttentionScore")
def fused_infer_attention_score(ctx: Ctx, ins, a):
    n = ctx.named(ins)
    unsupported = [k for k, v in n.items() if v is not None and k not in
                   ("query", "key0", "value0", "atten_mask", "actual_seq_lengths", "actual_seq_lengths_kv",
                    "block_table", "key_antiquant_scale", "value_antiquant_scale")]
    if unsupported:
        raise ctx.fail(f"inputs {unsupported} not implemented by the reference")
    q, key, value = n["query"], n["key0"], n["value0"]
    mask, bt = n.get("atten_mask"), n.get("block_table")
    if n.get("key_antiquant_scale") is not None or n.get("value_antiquant_scale") is not None or \
            key.dtype == torch.int8 or value.dtype == torch.int8:
        key, value = _antiquant_paged(ctx, n, a, q, key, value, bt)
    H = int(a["num_heads"])
    Hkv = int(a.get("num_key_value_heads", 0)) or H
    layout, mode = a.get("input_layout", "BSH"), int(a.get("sparse_mode", 0))
    scale, lse_flag = float(a.get("scale", 1.0)), bool(a.get("softmax_lse_flag", False))
    if H % Hkv or H // Hkv > 64:
        raise ctx.fail(f"num_heads {H} / num_key_value_heads {Hkv}: must divide, ratio <= 64 (documented)")
    ctx.findings.assume("FusedInferAttentionScore GQA: query head h reads kv head h // (num_heads / "
                        "num_key_value_heads) (the page says GQA, not the mapping)")
    # Queries per batch: [S_b, H, D].
    want_rank = {"BSND": 4, "TND": 3}.get(layout)
    if want_rank is not None and q.dim() != want_rank:
        raise ctx.fail(f"input_layout {layout} needs a rank-{want_rank} query, got {tuple(q.shape)}")
    if layout == "BSND":
        B, S, N, D = q.shape
        qs = [q[b] for b in range(B)]
        qlens = [S] * B if n.get("actual_seq_lengths") is None or S == 1 else \
            _lengths(n["actual_seq_lengths"], B, ctx, "actual_seq_lengths")
    elif layout == "TND":
        T, N, D = q.shape
        if n.get("actual_seq_lengths") is None or n.get("actual_seq_lengths_kv") is None:
            raise ctx.fail("TND needs actual_seq_lengths and actual_seq_lengths_kv (documented)")
        ends = _ints(n["actual_seq_lengths"])
        ctx.findings.assume("FusedInferAttentionScore TND: actual_seq_lengths(_kv) read as prefix sums "
                            "(stated on the LightningIndexer / SparseFlashAttention pages, not on FIA's)")
        B = len(ends)
        starts = [0] + ends[:-1]
        if any(e < s for s, e in zip(starts, ends)) or (ends and ends[-1] > T):
            raise ctx.fail(f"actual_seq_lengths {ends} are not non-decreasing prefix sums <= T = {T}")
        qs = [q[s:e] for s, e in zip(starts, ends)]
        qlens = [e - s for s, e in zip(starts, ends)]
        if ends and ends[-1] < T:
            ctx.findings.assume("FusedInferAttentionScore TND: rows past the last prefix sum get 0 "
                                "(undocumented)", T - ends[-1])
    else:
        raise ctx.fail(f"input_layout {layout!r} not implemented (BSND, TND)")
    if N != H:
        raise ctx.fail(f"num_heads {H} != query N axis {N} (documented: must equal)")
    # Keys per batch: [L_b, Hkv, D].
    if bt is not None:
        if key.dim() != 3:
            raise ctx.fail(f"paged key of rank {key.dim()}: only BnBsH [blocks, block_size, H] implemented")
        NB, BS, Hk = key.shape
        if BS != int(a.get("block_size", 0)):
            raise ctx.fail(f"block_size attr {a.get('block_size')} != key's block dim {BS}")
        if BS % 16:
            ctx.findings.note(f"FIA paged attention: block_size {BS} is not 16-aligned (CANN requires it; CI "
                              "shapes only)")
        if Hk % Hkv or value.shape[2] % Hkv:
            raise ctx.fail(f"key H {Hk} is not num_key_value_heads {Hkv} x D")
        if bt.shape[0] != B:
            raise ctx.fail(f"block_table first dim {bt.shape[0]} != B = {B} (documented: must equal)")
        if n.get("actual_seq_lengths_kv") is None:
            raise ctx.fail("paged attention needs actual_seq_lengths_kv (documented)")
        kvl = _lengths(n["actual_seq_lengths_kv"], B, ctx, "actual_seq_lengths_kv")
        if layout == "TND":
            kvl = [e - s for s, e in zip([0] + kvl[:-1], kvl)]
        _within(kvl, bt.shape[1] * BS, ctx, "actual_seq_lengths_kv")
        ks = [_pages(key, bt[b], kvl[b], ctx, "key").reshape(kvl[b], Hkv, Hk // Hkv) for b in range(B)]
        vs = [_pages(value, bt[b], kvl[b], ctx, "value").reshape(kvl[b], Hkv, value.shape[2] // Hkv)
              for b in range(B)]
    elif layout == "TND":
        ends = _ints(n["actual_seq_lengths_kv"])
        if len(ends) != B or key.shape[1] != Hkv:
            raise ctx.fail(f"TND key: {len(ends)} kv prefix sums for B = {B}, key N {key.shape[1]} vs {Hkv}")
        starts = [0] + ends[:-1]
        ks = [key[s:e] for s, e in zip(starts, ends)]
        vs = [value[s:e] for s, e in zip(starts, ends)]
        kvl = [e - s for s, e in zip(starts, ends)]
    else:
        if key.shape[2] != Hkv:
            raise ctx.fail(f"key N axis {key.shape[2]} != num_key_value_heads {Hkv} (documented: must equal)")
        kvl = [key.shape[1]] * B if n.get("actual_seq_lengths_kv") is None else \
            _lengths(n["actual_seq_lengths_kv"], B, ctx, "actual_seq_lengths_kv")
        ks = [key[b, :kvl[b]] for b in range(B)]
        vs = [value[b, :kvl[b]] for b in range(B)]
    if ks and ks[0].shape[-1] != D:
        raise ctx.fail(f"query D {D} != key D {ks[0].shape[-1]}")
    # Masks: mode 0 without a mask attends everything (pre/next_tokens ignored, documented).
    if mode == 0 and mask is not None:
        raise ctx.fail("sparse_mode 0 with a full atten_mask not implemented")
    if mode == 3 and (mask is None or not _causal_mask_ok(mask)):
        raise ctx.fail("sparse_mode 3 needs the optimised 2048 x 2048 causal atten_mask (documented)")
    if mode not in (0, 3):
        raise ctx.fail(f"sparse_mode {mode} not implemented (0, 3)")
    Dv = value.shape[-1] // Hkv if bt is not None else value.shape[-1]  # paged value is [blocks, BS, Hkv * Dv]
    empty_lse = float(ctx.variant.get("fia_empty_lse", "-inf"))
    outs, lses, empty_rows = [], [], 0
    for b in range(B):
        S1, S2 = qs[b].shape[0], kvl[b]
        rows = torch.arange(S1)[:, None]
        cols = torch.arange(S2)[None, :]
        visible = (rows < qlens[b]) & (cols < S2)
        if mode == 3:  # rightDownCausal: query i sees key j <= i + (S2 - S1)
            visible = visible & (cols <= rows + (S2 - qlens[b]))
        out, lse = _attend(qs[b], ks[b], vs[b], visible.expand(S1, S2), scale)
        none = ~visible.any(dim=1)  # [S1]
        empty_rows += int(none.sum()) * H
        out = torch.where(none[:, None, None], torch.zeros_like(out), out)
        lse = torch.where(none[:, None], torch.full_like(lse, empty_lse), lse)
        outs.append(out)
        lses.append(lse)
    ctx.findings.assume(f"FusedInferAttentionScore: a row with no visible key gives out 0 (documented only for "
                        f"an empty key tensor) and LSE {ctx.variant.get('fia_empty_lse', '-inf')} "
                        f"(undocumented: 'inf is invalid')", empty_rows)
    dtype = q.dtype
    if layout == "BSND":
        out = torch.stack(outs).to(dtype)  # [B, S, N, Dv]
        lse = torch.stack(lses).permute(0, 2, 1)[..., None]  # [B, N, S, 1]
    else:
        T = q.shape[0]
        out = torch.zeros(T, H, Dv, dtype=dtype)
        lse = torch.full((T, H), float(empty_lse))
        s = 0
        for o, l_ in zip(outs, lses):
            out[s:s + o.shape[0]] = o.to(dtype)
            lse[s:s + o.shape[0]] = l_
            s += o.shape[0]
        lse = lse[..., None]  # [T, N, 1]
    if not lse_flag:
        lse = torch.zeros(1)  # documented: a {1} tensor of zeros
    return [out, lse.float()]


@op("AttentionUpdate")
def attention_update(ctx: Ctx, ins, a):
    lse = [v for k, v in zip(ctx.names, ins) if k.startswith("lse")]
    go = [v for k, v in zip(ctx.names, ins) if k.startswith("go")]
    sp, update_type = int(a["sp"]), int(a["update_type"])
    if not (1 <= sp <= 16) or len(lse) != sp or len(go) != sp:
        raise ctx.fail(f"sp {sp} with {len(lse)} lse / {len(go)} out inputs (documented: sp in [1, 16], "
                       "lists of length sp)")
    if update_type not in (0, 1):
        raise ctx.fail(f"update_type {update_type} (documented: 0 or 1)")
    L = torch.stack([x.float() for x in lse])  # [sp, M]
    O = torch.stack([x.float() for x in go])  # [sp, M, D]
    if L.shape[1] != O.shape[1]:
        raise ctx.fail(f"lse rows {L.shape[1]} != out rows {O.shape[1]}")
    # The page's formula, literally: no special case for -inf (an all -inf row gives NaN).
    all_inf = int((~torch.isfinite(L)).all(dim=0).sum())
    ctx.findings.assume("AttentionUpdate: a row whose every LSE is -inf follows the formula literally (NaN; "
                        "undocumented)", all_inf)
    lmax = L.max(dim=0).values
    lse_m = lmax + torch.log(torch.exp(L - lmax).sum(dim=0))
    out = (O * torch.exp(L - lse_m)[..., None]).sum(dim=0).to(go[0].dtype)
    return [out, lse_m] if update_type == 1 else [out, torch.zeros(1)]


@op("ScatterPaKvCache")
def scatter_pa_kv_cache(ctx: Ctx, ins, a):
    n = ctx.named(ins)
    if a.get("cache_mode", "Norm") != "Norm" or a.get("scatter_mode", "None") != "None":
        raise ctx.fail(f"cache_mode {a.get('cache_mode')} / scatter_mode {a.get('scatter_mode')} not implemented")
    if list(a.get("strides", [1, 1])) != [1, 1] or list(a.get("offsets", [0, 0])) != [0, 0]:
        raise ctx.fail(f"strides {a.get('strides')} / offsets {a.get('offsets')} not implemented")
    if any(n.get(k) is not None for k in ("compress_lens", "compress_seq_offset", "seq_lens")):
        raise ctx.fail("compression inputs not implemented")
    slots = n["slot_mapping"].long().reshape(-1)
    for kname, cname in (("key", "key_cache"), ("value", "value_cache")):
        new, cache = n[kname], n[cname]
        if new.dim() != 3 or cache.dim() != 4 or tuple(new.shape[1:]) != tuple(cache.shape[2:]):
            raise ctx.fail(f"{kname} {tuple(new.shape)} / {cname} {tuple(cache.shape)}: want [T, N, D] / "
                           "[blocks, block_size, N, D] (documented, 3-D key)")
        NB, BS = cache.shape[:2]
        bad = (slots < 0) | (slots >= NB * BS)
        if bool(bad.any()):
            raise ctx.fail(f"slot_mapping {slots[bad].tolist()} outside [0, {NB * BS}) (documented: "
                           "slot_mapping in range [0, num_blocks * block_size - 1])")
        if slots.unique().numel() != slots.numel():
            raise ctx.fail("slot_mapping values repeat (documented: must be unique)")
        cache.view(NB * BS, *cache.shape[2:])[slots] = new.to(cache.dtype)
    return [n["key_cache"], n["value_cache"]]


def _check_tokens(ctx, a):
    for k in ("pre_tokens", "next_tokens"):
        if int(a.get(k, MAX_INT64)) != MAX_INT64:
            raise ctx.fail(f"{k} {a.get(k)} (documented: only 2^63-1)")


@op("LightningIndexer")
def lightning_indexer(ctx: Ctx, ins, a):
    n = ctx.named(ins)
    q, key, w = n["query"], n["key"], n["weights"]
    bt = n.get("block_table")
    k_top, mode = int(a["sparse_count"]), int(a.get("sparse_mode", 0))
    if a.get("layout_query") != "TND" or a.get("layout_key") != "PA_BSND":
        raise ctx.fail(f"layouts {a.get('layout_query')} / {a.get('layout_key')} not implemented (TND / PA_BSND)")
    _check_tokens(ctx, a)
    if mode not in (0, 3):
        raise ctx.fail(f"sparse_mode {mode} (documented: 0 or 3)")
    if not (1 <= k_top <= 2048 or k_top in (3072, 4096, 5120, 6144, 7168, 8192)):
        raise ctx.fail(f"sparse_count {k_top} outside the documented set")
    if n.get("actual_seq_lengths_query") is None or n.get("actual_seq_lengths_key") is None or bt is None:
        raise ctx.fail("TND query and PA_BSND key need actual_seq_lengths_query / _key and block_table "
                       "(documented)")
    T1, N1, D = q.shape
    NB, BS, N2, Dk = key.shape
    if N2 != 1 or Dk != D or tuple(w.shape) != (T1, N1):
        raise ctx.fail(f"key {tuple(key.shape)} / weights {tuple(w.shape)} for query {tuple(q.shape)}")
    if D != 128 or BS % 16:
        ctx.findings.note(f"LightningIndexer: head dim {D} / block_size {BS} (CANN: head dim 128, block size a "
                          "multiple of 16; CI shapes only)")
    ends = _ints(n["actual_seq_lengths_query"])  # documented: prefix sums (TND)
    B = len(ends)
    starts = [0] + ends[:-1]
    if any(e < s for s, e in zip(starts, ends)) or ends[-1] > T1:
        raise ctx.fail(f"actual_seq_lengths_query {ends} are not non-decreasing prefix sums <= T1 = {T1}")
    klen = _ints(n["actual_seq_lengths_key"])  # documented: per batch under PA_BSND
    if len(klen) != B or bt.shape[0] != B:
        raise ctx.fail(f"{len(klen)} key lengths / block_table {tuple(bt.shape)} for B = {B}")
    _within(klen, bt.shape[1] * BS, ctx, "actual_seq_lengths_key")
    out = torch.full((T1, 1, k_top), -1, dtype=torch.int32)
    for b in range(B):
        S1, S2 = ends[b] - starts[b], klen[b]
        if S1 == 0:
            continue
        keys = _pages(key, bt[b], S2, ctx, "key")[:, 0].float()  # [S2, D]
        qb, wb = q[starts[b]:ends[b]].float(), w[starts[b]:ends[b]].float()
        score = torch.einsum("th,ths->ts", wb, torch.relu(torch.einsum("thd,sd->ths", qb, keys)))  # [S1, S2]
        rows, cols = torch.arange(S1)[:, None], torch.arange(S2)[None, :]
        visible = cols < S2
        if mode == 3:  # rightDownCausal
            visible = visible & (cols <= rows + (S2 - S1))
        score = score.masked_fill(~visible, float("-inf"))
        order = torch.sort(score, dim=-1, descending=True, stable=True).indices[:, :k_top]
        picked = torch.gather(visible.expand(S1, S2), 1, order)
        out[starts[b]:ends[b], 0, :order.shape[1]] = torch.where(picked, order, -1).to(torch.int32)
    ctx.findings.assume("LightningIndexer: top-k in descending score, ties to the lower position, -1 after the "
                        "last visible key (the page gives the formula, not the order or the padding)")
    if ends[-1] < T1:
        ctx.findings.assume("LightningIndexer: rows past the last prefix sum are -1 (undocumented)", T1 - ends[-1])
    return [out, torch.zeros(T1, 1, k_top, dtype=q.dtype)]


@op("SparseFlashAttention")
def sparse_flash_attention(ctx: Ctx, ins, a):
    n = ctx.named(ins)
    q, key, value, idx, bt = n["query"], n["key"], n["value"], n["sparse_indices"], n.get("block_table")
    if a.get("layout_query") != "TND" or a.get("layout_kv") != "PA_BSND":
        raise ctx.fail(f"layouts {a.get('layout_query')} / {a.get('layout_kv')} not implemented (TND / PA_BSND)")
    _check_tokens(ctx, a)
    if int(a.get("sparse_block_size", 1)) != 1:
        raise ctx.fail(f"sparse_block_size {a.get('sparse_block_size')} not implemented (1: token-wise)")
    mode = int(a.get("sparse_mode", 0))
    if mode not in (0, 3):
        raise ctx.fail(f"sparse_mode {mode} (documented: 0 or 3)")
    if n.get("query_rope") is not None or n.get("key_rope") is not None:
        raise ctx.fail("query_rope / key_rope not implemented (the converters attend the whole row)")
    if bt is None or n.get("actual_seq_lengths_query") is None or n.get("actual_seq_lengths_kv") is None:
        raise ctx.fail("PA_BSND needs block_table and actual_seq_lengths_kv, TND actual_seq_lengths_query "
                       "(documented: must be passed)")
    T1, N1, D = q.shape
    NB, BS, N2, Dk = key.shape
    if N2 != 1 or Dk != D or tuple(value.shape) != tuple(key.shape):
        raise ctx.fail(f"key {tuple(key.shape)} / value {tuple(value.shape)} for query {tuple(q.shape)}")
    if int(a.get("attention_mode", 0)) != 2:
        ctx.findings.note(f"SparseFlashAttention: attention_mode {a.get('attention_mode')} (CANN documents only 2, "
                          "MLA-absorb, with query_rope / key_rope)")
    if D != 512 or BS % 16:
        ctx.findings.note(f"SparseFlashAttention: D {D} / block_size {BS} (CANN: D 512 + rope 64, block size a "
                          "multiple of 16; CI shapes only)")
    lse_flag = bool(a.get("return_softmax_lse", False))
    if lse_flag:
        ctx.findings.note("SparseFlashAttention: return_softmax_lse with PA_BSND in graph mode (CANN: 'not "
                          "supported in graph mode', 'only in training mode when layout_kv is not PA_BSND')")
    ends = _ints(n["actual_seq_lengths_query"])
    B = len(ends)
    starts = [0] + ends[:-1]
    klen = _ints(n["actual_seq_lengths_kv"])
    if len(klen) != B or bt.shape[0] != B or ends[-1] > T1:
        raise ctx.fail(f"{len(klen)} kv lengths, block_table {tuple(bt.shape)}, prefix sums {ends} for T1 = {T1}")
    _within(klen, bt.shape[1] * BS, ctx, "actual_seq_lengths_kv")
    K = idx.shape[-1]
    ind = idx.reshape(T1, K).long()
    valid = ind >= 0
    if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
        raise ctx.fail("a valid index after an invalid one (documented: valid values first, invalid after)")
    scale = float(a["scale_value"])
    out = torch.zeros(T1, N1, D, dtype=torch.float32)
    smax = torch.full((1, T1, N1), float("-inf"))
    ssum = torch.zeros(1, T1, N1)
    for b in range(B):
        S1, S2 = ends[b] - starts[b], klen[b]
        if S1 == 0:
            continue
        kv = _pages(key, bt[b], S2, ctx, "key")[:, 0].float()  # [S2, D]
        rows = slice(starts[b], ends[b])
        ib, vb = ind[rows], valid[rows]
        if bool((ib[vb] >= S2).any()):
            raise ctx.fail(f"sparse index >= actual_seq_lengths_kv {S2} (undocumented whether it is read)")
        if mode == 3:  # rightDownCausal over the indices
            vb = vb & (ib <= torch.arange(S1)[:, None] + (S2 - S1))
        sel = kv[ib.clamp(min=0)]  # [S1, K, D]
        s = torch.einsum("thd,tkd->thk", q[rows].float(), sel) * scale
        s = s.masked_fill(~vb[:, None, :], float("-inf"))
        m = s.max(dim=-1).values  # [S1, N1]
        m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        p = torch.where(vb[:, None, :], torch.exp(s - m_safe[..., None]), torch.zeros_like(s))
        den = p.sum(-1)
        out[rows] = torch.where(den[..., None] > 0, torch.einsum("thk,tkd->thd", p, sel) /
                                den.clamp(min=1e-30)[..., None], torch.zeros(()))
        smax[0, rows], ssum[0, rows] = m, den
    ctx.findings.assume("SparseFlashAttention: a row with no valid index gives out 0, softmax_max -inf, "
                        "softmax_sum 0 (undocumented)", int((~valid).all(dim=1).sum()))
    if ends[-1] < T1:
        ctx.findings.assume("SparseFlashAttention: rows past the last prefix sum are 0 (undocumented)",
                            T1 - ends[-1])
    return [out.to(q.dtype), smax, ssum]


@op("QuantBatchMatmulV3")
def quant_batch_matmul_v3(ctx: Ctx, ins, a):
    n = ctx.named(ins)
    x1, x2, scale = n["x1"], n["x2"], n["scale"]
    if x1.dtype != torch.int8 or x2.dtype != torch.int8:
        raise ctx.fail(f"x1 {x1.dtype} / x2 {x2.dtype}: only int8 x int8 implemented")
    if n.get("offset") is not None or n.get("pertoken_scale") is not None or int(a.get("group_size", 0)):
        raise ctx.fail("offset / pertoken_scale / group_size not implemented")
    if a.get("transpose_x1"):
        x1 = x1.transpose(-1, -2)
    if a.get("transpose_x2"):
        x2 = x2.transpose(-1, -2)
    acc = torch.matmul(x1.to(torch.int64), x2.to(torch.int64))  # exact integer products
    if n.get("bias") is not None:
        acc = acc + n["bias"].to(torch.int64)
    out_dtype = ge_dtype(int(a["dtype"]))
    if out_dtype == torch.int32:
        # The dtype table lists int8 x int8, float32 scale, int32 out; whether scale is
        # applied to an int32 result is not said: with scale 1 both readings agree.
        if not bool((scale.float() == 1).all()):
            ctx.findings.assume("QuantBatchMatmulV3: int32 output with scale != 1 (scale left unapplied; "
                                "undocumented)")
        if acc.numel() and int(acc.abs().max()) >= 2 ** 31:
            raise ctx.fail("int32 accumulator overflow")
        return acc.to(torch.int32)
    if scale.dtype not in (torch.float32, torch.bfloat16):
        raise ctx.fail(f"scale dtype {scale.dtype} (uint64-packed scales) not implemented")
    return (acc.double() * scale.double()).to(out_dtype)


def fia_lse_variants() -> list[dict[str, str]]:
    return [{"fia_empty_lse": v} for v in VARIANTS["fia_empty_lse"]]

