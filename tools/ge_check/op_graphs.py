"""The op graphs: one small call per cp:: op (and the aten ops the project converts
itself), compiled alone through `torchair.get_npu_backend` in max-autotune mode, and
what each op's GE graph must hold."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tools.ge_check.reading import FxRecorder, GraphResult, compile_and_load

# Seed of the op graphs' block table and sparse indices (the activations stay
# torch.randn): a failure by index reproduces. That data must not be degenerate
# (issue 35 item 8): with an all-zero block table a converter that gathers the wrong
# table row or the table transposed reads the same page, and with all-zero sparse
# indices one that drops an index attends the same key one time fewer. The index caches
# the indexers score are random too: over an all-zero cache every score ties, the top-k
# is the first positions whatever pages are read, and a converter that hands
# LightningIndexer the wrong block-table rows passed. The FX kernel and the evaluator
# score alike (fp32, a stable sort: ties to the lower position), so the data may tie.
INPUT_SEED = 35


def shuffled_block_table(requests: int, blocks_per_request: int, pages: int,
                         generator: torch.Generator) -> torch.Tensor:
    """[requests, blocks_per_request] int32: the first requests * blocks_per_request
    pages of a seeded permutation of 0..pages-1, so no two entries (within a request or
    across requests) name the same page and the order is not 0, 1, 2, ..."""
    need = requests * blocks_per_request
    if need > pages:
        raise ValueError(f"{need} distinct pages wanted of {pages}")
    return torch.randperm(pages, generator=generator)[:need].reshape(requests, blocks_per_request).to(torch.int32)


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, tokens: int) -> list[tuple[int, int]]:
    """(request, position) of each of `tokens` query tokens, (-1, -1) for padding past
    the last request: a request's queries are the last positions of its sequence."""
    out = []
    qsl, seq = query_start_loc.tolist(), seq_lens.tolist()
    for t in range(tokens):
        req = next((b for b in range(len(seq)) if qsl[b] <= t < qsl[b + 1]), -1)
        out.append((req, seq[req] - (qsl[req + 1] - t)) if req >= 0 else (-1, -1))
    return out


def slots_of(table: torch.Tensor, positions: list[tuple[int, int]], block_size: int) -> torch.Tensor:
    """[T] int64 cache slots page * block_size + offset, the page read from `table` (the
    slots the attention then reads through the same table); -1 for padding tokens."""
    return torch.tensor([int(table[r, p // block_size]) * block_size + p % block_size if r >= 0 else -1
                         for r, p in positions])


def distinct_sparse_indices(lengths: list[int], topk: int, generator: torch.Generator,
                            short_rows: tuple[int, ...] = ()) -> torch.Tensor:
    """[len(lengths), topk] int32: per row, distinct random positions below its length
    (its causal key count) in random order, valid ones first and -1 after (the padding
    SparseFlashAttention and the reference skip). Rows in `short_rows` keep one index
    fewer, so -1 padding also appears inside a real row."""
    out = torch.full((len(lengths), topk), -1, dtype=torch.int32)
    for t, n in enumerate(lengths):
        k = min(topk - (t in short_rows), n)
        out[t, :k] = torch.randperm(n, generator=generator)[:k].to(torch.int32)
    return out


def op_cases() -> dict[str, tuple[Callable[..., Any], tuple]]:
    """One small call per cp:: op: bf16 activations, fp32 LSEs, the example models' head layouts."""
    bf = torch.bfloat16
    # nb = 3 blocks per request (2 are read: 5 and 7 keys at BS 4), 6 distinct of the
    # NB - 1 = 7 pages that are not the scratch block.
    T, B, NB, BS, nb = 6, 2, 8, 4, 3
    Hq, Hkv, D = 8, 2, 64
    H, L, R = 8, 64, 16
    gen = torch.Generator().manual_seed(INPUT_SEED)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    seq = torch.tensor([5, 7], dtype=torch.int32)
    table = shuffled_block_table(B, nb, NB - 1, gen)
    positions = token_positions(qsl, seq, T)  # req 0 at 3, 4; req 1 at 4, 5, 6; token 5 padding
    slots = slots_of(table, positions, BS)  # where the attention then reads each new token
    kv_lens = torch.tensor([p + 1 if r >= 0 else 0 for r, p in positions], dtype=torch.int32)  # causal
    # Top-k positions within each token's causal length ([4, 5, 5, 6, 7, 0]); the DSA-CP
    # rows attention's 3 rows (rank 1's rows 3..5: tokens 3, 4 and the padding token 5)
    # take those tokens' lengths.
    topk = distinct_sparse_indices(kv_lens.tolist(), 4, gen, short_rows=(1,))
    partial_topk = distinct_sparse_indices(kv_lens.tolist(), 4, gen, short_rows=(2,))
    rows_topk = distinct_sparse_indices(kv_lens[3:].tolist(), 4, gen, short_rows=(0,))
    mine, other = torch.randn(T, 2 * Hq), torch.randn(T, 2 * Hq)  # per-token LSEs of two DCP ranks
    mine[4:] = float("-inf")
    other[5] = float("-inf")
    cp = torch.ops.cp
    from cp_compile.ops.core.scratch_block import mark_scratch_block

    def cache(make: Callable[..., torch.Tensor], *shape: int, dtype: torch.dtype) -> torch.Tensor:
        # A paged cache as allocate_kv_cache(..., scratch_block=True) makes it: its last
        # page (block NB - 1, named by no table and no slot here) is the scratch block
        # the GE cache writes send slot -1 to (ops/core/scratch_block.py).
        t = make(*shape, dtype=dtype)
        mark_scratch_block(t)
        return t

    i8, f32 = torch.int8, torch.float32

    def codes(*shape: int) -> torch.Tensor:  # int8 pages: every code, -127..127
        return torch.randint(-127, 128, shape, generator=gen, dtype=i8)

    def scales(*shape: int) -> torch.Tensor:  # fp32 scales in [0.005, 0.025): rows of magnitude <= ~3
        return torch.rand(shape, generator=gen) * 0.02 + 0.005

    def marked(t: torch.Tensor) -> torch.Tensor:
        mark_scratch_block(t)
        return t

    return {
        "cp::dcp_localize_metadata": (lambda s, q, sl: cp.dcp_localize_metadata(s, q, sl, 2, 1, 1, BS),
                                      (slots, qsl, seq)),
        # Returns the cache's pages (the scratch block, where slot -1 lands, is undefined).
        "cp::cache_write": (lambda n, c, s: (cp.cache_write(n, c, s), c[:-1])[1],
                            (torch.randn(T, Hkv, D, dtype=bf), cache(torch.zeros, NB, BS, Hkv, D, dtype=bf), slots)),
        "cp::paged_attention_lse": (lambda q, k, v, t, qs, kl: cp.paged_attention_lse(q, k, v, t, qs, kl, 0.125),
                                    (torch.randn(T, Hq, D, dtype=bf), cache(torch.randn, NB, BS, Hkv, D, dtype=bf),
                                     cache(torch.randn, NB, BS, Hkv, D, dtype=bf), table, qsl, kv_lens)),
        "cp::mla_partial_attention": (lambda qn, qp, c, t, qs, kl: cp.mla_partial_attention(qn, qp, c, t, qs, kl, 0.1),
                                      (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf),
                                       cache(torch.randn, NB, BS, L + R, dtype=bf), table, qsl, kv_lens)),
        # Quantised KV cache (issue 39, decision 70): int8 pages with random per-token, per-head
        # fp32 scales (distinct per head, so a converter reading another head's or the key's
        # scale differs by value), the writes' caches marked like the model-dtype ones.
        "cp::quant_cache_write": (lambda n, c, sc, s: (cp.quant_cache_write(n, c, sc, s), c[:-1], sc[:-1])[1:],
                                  (torch.randn(T, Hkv, D, dtype=bf), cache(torch.zeros, NB, BS, Hkv, D, dtype=i8),
                                   cache(torch.ones, NB, BS, Hkv, dtype=f32), slots)),
        "cp::paged_attention_lse[int8]": (
            lambda q, k, v, t, qs, kl, ks, vs: cp.paged_attention_lse(q, k, v, t, qs, kl, 0.125, ks, vs),
            (torch.randn(T, Hq, D, dtype=bf), codes(NB, BS, Hkv, D), codes(NB, BS, Hkv, D), table, qsl, kv_lens,
             scales(NB, BS, Hkv), scales(NB, BS, Hkv))),
        "cp::mla_partial_attention[int8]": (
            lambda qn, qp, c, t, qs, kl, sc: cp.mla_partial_attention(qn, qp, c, t, qs, kl, 0.1, sc),
            (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf), codes(NB, BS, L + R), table, qsl,
             kv_lens, scales(NB, BS, 1))),
        "cp::gqa_paged_attention_quant": (
            lambda q, k, v, kc, vc, ks, vs, s, t, sl, qs: cp.gqa_paged_attention_quant(q, k, v, kc, vc, ks, vs, s, t,
                                                                                     sl, qs, 0.125),
            (torch.randn(T, Hq, D, dtype=bf), torch.randn(T, Hkv, D, dtype=bf), torch.randn(T, Hkv, D, dtype=bf),
             marked(codes(NB, BS, Hkv, D)), marked(codes(NB, BS, Hkv, D)), marked(scales(NB, BS, Hkv)),
             marked(scales(NB, BS, Hkv)), slots, table, seq, qsl)),
        "cp::mla_attention_quant": (
            lambda qn, qp, c, kp, kv, sc, s, t, sl, qs: cp.mla_attention_quant(qn, qp, c, kp, kv, sc, s, t, sl, qs,
                                                                               0.1),
            (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf), torch.randn(T, L, dtype=bf),
             torch.randn(T, R, dtype=bf), marked(codes(NB, BS, L + R)), marked(scales(NB, BS, 1)), slots, table, seq,
             qsl)),
        # Empty shards: token 4 has no key on this rank, token 5 (padding) on none.
        "cp::lse_rescale": (lambda o, l, la: cp.lse_rescale(o, l, la),
                            (torch.randn(T, 2 * Hq, D, dtype=bf), mine, torch.cat([mine.T, other.T]))),
        "cp::lse_combine": (lambda o, l: cp.lse_combine(o, l),
                            (torch.randn(2, Hq, T, D, dtype=bf), torch.stack([mine[:, :Hq].T, other[:, :Hq].T]))),
        "cp::gqa_paged_attention": (
            lambda q, k, v, kc, vc, s, t, sl, qs: cp.gqa_paged_attention(q, k, v, kc, vc, s, t, sl, qs, 0.125),
            (torch.randn(T, Hq, D, dtype=bf), torch.randn(T, Hkv, D, dtype=bf), torch.randn(T, Hkv, D, dtype=bf),
             cache(torch.zeros, NB, BS, Hkv, D, dtype=bf), cache(torch.zeros, NB, BS, Hkv, D, dtype=bf), slots, table,
             seq, qsl)),
        "cp::mla_attention": (
            lambda qn, qp, c, kp, kv, s, t, sl, qs: cp.mla_attention(qn, qp, c, kp, kv, s, t, sl, qs, 0.1),
            (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf), torch.randn(T, L, dtype=bf),
             torch.randn(T, R, dtype=bf), cache(torch.zeros, NB, BS, L + R, dtype=bf), slots, table, seq, qsl)),
        "cp::lightning_indexer": (
            lambda qi, ki, w, ic, s, t, sl, qs: cp.lightning_indexer(qi, ki, w, ic, s, t, sl, qs, 4),
            (torch.randn(T, 4, 32, dtype=bf), torch.randn(T, 32, dtype=bf), torch.randn(T, 4, dtype=bf),
             cache(torch.randn, NB, BS, 32, dtype=bf), slots, table, seq, qsl)),
        "cp::sparse_mla_attention": (
            lambda qn, qp, c, kp, kv, s, t, sl, qs, ti: cp.sparse_mla_attention(qn, qp, c, kp, kv, s, t, sl, qs, ti,
                                                                                0.1),
            (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf), torch.randn(T, L, dtype=bf),
             torch.randn(T, R, dtype=bf), cache(torch.zeros, NB, BS, L + R, dtype=bf), slots, table, seq, qsl,
             topk)),
        "cp::sparse_mla_partial_attention": (
            lambda qn, qp, c, t, qs, i: cp.sparse_mla_partial_attention(qn, qp, c, t, qs, i, 0.1),
            (torch.randn(T, 2 * H, L, dtype=bf), torch.randn(T, 2 * H, R, dtype=bf),
             cache(torch.randn, NB, BS, L + R, dtype=bf), table, qsl, partial_topk)),
        # SFA over an int8 latent (issue 39, decision 75): random codes and per-token scales,
        # dequantised-on-gather before SparseFlashAttention (ops/sparse/ge_quant.py).
        "cp::sparse_mla_partial_attention[int8]": (
            lambda qn, qp, c, t, qs, i, sc: cp.sparse_mla_partial_attention(qn, qp, c, t, qs, i, 0.1, sc),
            (torch.randn(T, 2 * H, L, dtype=bf), torch.randn(T, 2 * H, R, dtype=bf), codes(NB, BS, L + R), table,
             qsl, partial_topk, scales(NB, BS, 1))),
        "cp::sparse_mla_attention_quant": (
            lambda qn, qp, c, kp, kv, sc, s, t, sl, qs, ti: cp.sparse_mla_attention_quant(qn, qp, c, kp, kv, sc, s, t,
                                                                                          sl, qs, ti, 0.1),
            (torch.randn(T, H, L, dtype=bf), torch.randn(T, H, R, dtype=bf), torch.randn(T, L, dtype=bf),
             torch.randn(T, R, dtype=bf), marked(codes(NB, BS, L + R)), marked(scales(NB, BS, 1)), slots, table, seq,
             qsl, topk)),
        "cp::dcp_sparse_indices": (lambda i: cp.dcp_sparse_indices(i, 2, 1, 1, BS),
                                   (torch.tensor([[0, 5, 2, -1]] * T, dtype=torch.int32),)),
        # DSA-CP: rank 1's 3 rows of the 6 tokens at tp 2 (rows 3..5, the last one padding).
        "cp::lightning_indexer_topk_rows": (
            lambda qi, ic, w, t, sl, qs: cp.lightning_indexer_topk_rows(qi, ic, w, t, sl, qs, 2, 1, 4),
            (torch.randn(3, 4, 32, dtype=bf), cache(torch.randn, NB, BS, 32, dtype=bf), torch.randn(3, 4, dtype=bf),
             table, seq, qsl)),
        "cp::sparse_mla_rows_attention": (
            lambda qn, qp, c, t, sl, qs, i: cp.sparse_mla_rows_attention(qn, qp, c, t, sl, qs, i, 2, 1, 0.1),
            (torch.randn(3, H, L, dtype=bf), torch.randn(3, H, R, dtype=bf),
             cache(torch.randn, NB, BS, L + R, dtype=bf), table, seq, qsl, rows_topk)),
        "cp::sparse_mla_rows_attention[int8]": (
            lambda qn, qp, c, t, sl, qs, i, sc: cp.sparse_mla_rows_attention(qn, qp, c, t, sl, qs, i, 2, 1, 0.1, sc),
            (torch.randn(3, H, L, dtype=bf), torch.randn(3, H, R, dtype=bf), codes(NB, BS, L + R), table, seq, qsl,
             rows_topk, scales(NB, BS, 1))),
        # W8A8 o_proj (ops/quant/ops.py): int8 K-major weight [in, out], two activation groups
        # (the DSA-CP full-weight o_proj at tp 2).
        "cp::w8a8_dynamic_linear": (
            lambda x, w, s, o: cp.w8a8_dynamic_linear(x, w, s, o, 2),
            (torch.randn(T, 64, dtype=bf), torch.randint(-127, 128, (64, 32), dtype=torch.int8), torch.rand(32),
             torch.zeros(32, dtype=torch.int32))),
        "cp::w8a8_static_linear": (
            lambda x, w, s, o, qb, dq: cp.w8a8_static_linear(x, w, s, o, qb, dq),
            (torch.randn(T, 64, dtype=bf), torch.randint(-127, 128, (64, 32), dtype=torch.int8),
             torch.tensor([0.02, 0.03]), torch.tensor([1, -2], dtype=torch.int32),
             torch.zeros(2, 32, dtype=torch.int32), torch.rand(2, 32))),
        # MLAPO (ops/mla_preprocess/ops.py): q-LoRA 32, H heads of nope 16 + rope R, latent L, cache write;
        # then into a second cache in HF DeepSeek-V2's bf16 rope (rotated in fp32, issue 27).
        "cp::mla_preprocess": (
            lambda x, qa, qan, qb, kva, kvn, wuk, c, s, kv, sl, kv2: cp.mla_preprocess(
                x, qa, None, None, qan, qb, None, None, kva, None, None, kvn, wuk, c, s, kv, sl, 1e-6, 1e-6,
                "interleave") + cp.mla_preprocess(
                x, qa, None, None, qan, qb, None, None, kva, None, None, kvn, wuk, c, s, kv2, sl, 1e-6, 1e-6,
                "interleave_fp32"),
            (torch.randn(T, 64, dtype=bf), torch.randn(32, 64, dtype=bf), torch.ones(32, dtype=bf),
             torch.randn(H * (16 + R), 32, dtype=bf), torch.randn(L + R, 64, dtype=bf), torch.ones(L, dtype=bf),
             torch.randn(H, 16, L, dtype=bf), torch.rand(T, R // 2), torch.rand(T, R // 2),
             cache(torch.zeros, NB, BS, L + R, dtype=bf), slots, cache(torch.zeros, NB, BS, L + R, dtype=bf))),
        # Not a cp op: torchair's aten.constant_pad_nd converter refuses a symbolic pad,
        # ops/core/ge_aten_pad.py converts it (PadV3), as the DSA-CP prefill graph's token pad
        # needs (ops/parallel/dsa_cp.pad_tokens). Compiled with dynamic shapes (DYNAMIC_CASES):
        # the token dim's pad (2 * ceil(T / 2) - T, pad_tokens' formula at tp 2) is a SymInt;
        # the other dims' pads are static.
        "aten::constant_pad_nd": (lambda x: torch.nn.functional.pad(
            x, (1, 2, 0, 0, 0, (x.shape[0] + 1) // 2 * 2 - x.shape[0]), value=0.5),
                                  (torch.randn(7, 3, 4, dtype=bf),)),
    }


# Op cases compiled with dynamic shapes (the others are static).
DYNAMIC_CASES = {"aten::constant_pad_nd"}
# Op graphs whose GE path rounds through bf16 where the FX kernel stays in fp32: compared
# with bf16's tolerance, for the reason given.
BF16_PATHS = {"cp::lse_combine": (torch.bfloat16, "AttentionUpdate's out has localOut's dtype (bf16 here; the page "
                                                  "allows fp32 only on Atlas A3)")}
# SFA over an int8 latent (ops/sparse/ge_quant.py): SparseFlashAttention's key / value take the
# query's dtype (fp16 / bf16), so the dequantised rows are rounded to bf16 before the products,
# where the FX kernel keeps code * scale in fp32 (the LSE, fp32, moves by ~4e-3 here).
_SFA_INT8 = (torch.bfloat16, "SparseFlashAttention reads key / value in the query's dtype: the dequantised rows are "
                             "bf16, the FX kernel's fp32")
BF16_PATHS.update({case: _SFA_INT8 for case in ("cp::sparse_mla_partial_attention[int8]",
                                                 "cp::sparse_mla_attention_quant",
                                                 "cp::sparse_mla_rows_attention[int8]")})


def base_op(case: str) -> str:
    """An op graph's op: 'cp::paged_attention_lse[int8]' (a second case of one op) -> 'cp::paged_attention_lse'."""
    return case.split("[", 1)[0]


# FusedInferAttentionScore's antiquant mode in each quantised graph (ops/paged/ge.py): 5 per-token
# per-head page-managed scales (GQA), 4 per-token page-managed (the MLA latent's one scale).
ANTIQUANT_MODES = {"cp::paged_attention_lse[int8]": 5, "cp::gqa_paged_attention_quant": 5,
                   "cp::mla_partial_attention[int8]": 4, "cp::mla_attention_quant": 4}


def _unconverted_op() -> torch._ops.OpOverload:
    """A custom op with no GE converter (negative case)."""
    if not hasattr(torch.ops, "cp_check") or not hasattr(torch.ops.cp_check, "unconverted"):
        @torch.library.custom_op("cp_check::unconverted", mutates_args=())
        def unconverted(x: torch.Tensor) -> torch.Tensor:
            return x * 2

        @unconverted.register_fake
        def _(x):
            return torch.empty_like(x)
    return torch.ops.cp_check.unconverted.default


def _torchair_backend(dump: str | None) -> Callable[..., Any]:
    import torchair

    cfg = torchair.CompilerConfig()
    cfg.mode = "max-autotune"
    if dump:
        cfg.debug.graph_dump.type = "pbtxt"
        cfg.debug.graph_dump.path = dump
    return torchair.get_npu_backend(compiler_config=cfg)


def run_op_graphs(recorder: FxRecorder, dump: str | None, with_unconverted: bool,
                  only: list[str] | None = None) -> list[GraphResult]:
    results = []
    # Every op the project defines (an op listed here but not defined yet is skipped).
    cases = {k: v for k, v in op_cases().items() if not k.startswith("cp::") or hasattr(torch.ops.cp, base_op(k)[4:])}
    if with_unconverted:
        op = _unconverted_op()
        cases["cp_check::unconverted"] = (lambda x: op(x) + 1, (torch.randn(4, 4, dtype=torch.bfloat16),))
    if only:
        cases = {k: v for k, v in cases.items() if k in only or (with_unconverted and k == "cp_check::unconverted")}
    from tools.ge_eval import probe

    for name, (fn, args) in cases.items():
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=_torchair_backend(dump), fullgraph=True, dynamic=name in DYNAMIC_CASES)
        probe.TOLERANCE_DTYPE = BF16_PATHS.get(name, (None, ""))[0]
        results.append(compile_and_load(lambda: compiled(*args), f"op:{name}", recorder))
        probe.TOLERANCE_DTYPE = None
    return results


# aten ops the project converts itself (ops/core/ge_aten_pad.py): the GE ops their op graph
# must hold (GatherV2 builds PadV3's paddings from the symbolic pad: not torchair's converter).
ATEN_GE_OPS = {"aten::constant_pad_nd": ("PadV3", "GatherV2")}


def expect_op(r: GraphResult, case: str) -> list[str]:
    from cp_compile.ops.core.ge_registry import GE_OPS

    op = base_op(case)
    problems = [f"{op}: GE graph lacks {t}" for t in {**GE_OPS, **ATEN_GE_OPS}[op] if t not in r.ge_ops]
    if any("NO CONVERTER" in k for k in r.fx_targets):
        problems.append(f"FX nodes without converter: {[k for k in r.fx_targets if 'NO CONVERTER' in k]}")
    fia = r.attrs.get("FusedInferAttentionScore", [])
    for a in fia:
        if not a.get("softmax_lse_flag", False) and op not in ("cp::gqa_paged_attention", "cp::mla_attention",
                                                                "cp::gqa_paged_attention_quant",
                                                                "cp::mla_attention_quant"):
            problems.append(f"{op}: FusedInferAttentionScore without softmax_lse_flag")
    if op == "cp::paged_attention_lse" and fia and (fia[0].get("num_heads"), fia[0].get("num_key_value_heads"),
                                                    fia[0].get("input_layout"), fia[0].get("block_size")) != (
            8, 2, "BSND", 4):
        problems.append(f"{op}: FusedInferAttentionScore attrs {fia[0]}")
    if op == "cp::mla_partial_attention" and fia and (fia[0].get("num_heads"), fia[0].get("num_key_value_heads")) \
            != (8, 1):
        problems.append(f"{op}: FusedInferAttentionScore attrs {fia[0]}")
    if case in ANTIQUANT_MODES and [(f.get("key_antiquant_mode"), f.get("value_antiquant_mode")) for f in fia] != \
            [(ANTIQUANT_MODES[case],) * 2]:
        problems.append(f"{case}: FusedInferAttentionScore antiquant modes {fia} (want {ANTIQUANT_MODES[case]})")
    if op == "cp::sparse_mla_partial_attention" and \
            not r.attrs.get("SparseFlashAttention", [{}])[0].get("return_softmax_lse"):
        problems.append(f"{op}: SparseFlashAttention without return_softmax_lse")
    if op == "cp::dcp_sparse_indices" and r.attrs.get("Sort", [{}])[0].get("stable") is not True:
        problems.append(f"{op}: the compaction sort is not stable")
    if op == "cp::lse_combine" and r.attrs.get("AttentionUpdate", [{}])[0] != {"update_type": 1, "sp": 2}:
        problems.append(f"{op}: AttentionUpdate attrs {r.attrs.get('AttentionUpdate')}")
    return problems

