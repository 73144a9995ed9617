"""The GE value check catches wrong converters (docs/torchair.md, tools/ge_eval).

Each case breaks one converter module's text the way a reviewer would (module, old
text, new text), and the check runs that op's graph with the mutated module loaded in
place of the library's, every converter module importing it seeing the mutated copy
(one check process runs every case in turn, `--mutations`, tools/ge_check/converters.py,
and the library's converters last, which must pass): the check must fail and name the
op. The first three are the mutations that passed the structure-only check before the
value check existed; the "helper" rows mutate a function another converter
module imports, which passed before the harness imported every converter afresh.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.ops.conftest import run_check

# The converter modules (tools.ge_check.converters.converter_modules() lists them): each
# op family's ge*.py, and the helpers they share in ops/core.
OPS = "cp_compile.ops"

# (id, converter module, text, replacement, op graph that must fail)
MUTATIONS = [
    ("lse_rescale weights exp(total - mine)", f"{OPS}.merge.ge", "ge.Exp(ge.Sub(mine, total))",
     "ge.Exp(ge.Sub(total, mine))", "cp::lse_rescale"),
    ("k and v caches swapped in the GQA partial's FIA", f"{OPS}.paged.ge", "query, [k_cache], [v_cache], None",
     "query, [v_cache], [k_cache], None", "cp::paged_attention_lse"),
    ("localisation compares the owner with 0, not the rank", f"{OPS}.paged.ge_cache", "ge.Equal(owner, const(rank, I64))",
     "ge.Equal(owner, const(0, I64))", "cp::dcp_localize_metadata"),
    # lengths: the single-device causal length one short
    ("causal length pos instead of pos + 1", f"{OPS}.paged.ge",
     "return where(valid, ge.Add(pos, const(1, I64)), const(0, I64))", "return where(valid, pos, const(0, I64))",
     "cp::gqa_paged_attention"),
    # head counts: FIA told one kv head for a two-kv-head cache
    ("num_key_value_heads 1 for Hkv = 2", f"{OPS}.paged.ge", "heads=int(H), kv_heads=Hkv,",
     "heads=int(H), kv_heads=1,", "cp::paged_attention_lse"),
    # ranks: the DSA-CP row shard computed for rank 0 on rank 1
    ("DSA-CP indexer shard of rank 0", f"{OPS}.sparse.ge_dsa_cp",
     "cum, k, real = _shard_tnd(q_i, query_start_loc, seq_lens, rank)",
     "cum, k, real = _shard_tnd(q_i, query_start_loc, seq_lens, 0)", "cp::lightning_indexer_topk_rows"),
    # groups: the A2A merge pairs rank i's LSE with rank N-1-i's output
    ("AttentionUpdate partials out of order", f"{OPS}.merge.ge",
     "go = [reshape(x, [-1, dv]) for x in ge.SplitD(outs, split_dim=0, num_split=n)]",
     "go = [reshape(x, [-1, dv]) for x in ge.SplitD(outs, split_dim=0, num_split=n)][::-1]", "cp::lse_combine"),
    # groups: one activation scale for every W8A8 input group
    ("W8A8 static scale of group 0 for all groups", f"{OPS}.quant.ge",
     "s = reshape(cast(input_scale, F32), [1, groups, 1])",
     "s = ge.ReduceMaxD(reshape(cast(input_scale, F32), [1, groups, 1]), axes=[1], keep_dims=True)",
     "cp::w8a8_static_linear"),
    # cache slots: the GE cache write before issue 21's scratch block, slot -1 -> block -1
    # (CANN: out-of-range ScatterNdUpdate indices unsupported; the evaluator refuses them)
    ("slot -1 written as block -1 (no scratch block)", f"{OPS}.core.ge_util",
     "s = where(ge.GreaterEqual(s, const(0, I64)), s, scratch_slot(cache))", "s = s", "cp::cache_write"),
    # layouts: PadV3's paddings in torch's order (last dim first), the DSA-CP token pad's converter
    ("PadV3 paddings not reordered to dim-0-first", f"{OPS}.core.ge_aten_pad",
     "const(padv3_order(self.rank, int(pad_len)), I64)", "const(padv3_order(self.rank, int(pad_len))[::-1], I64)",
     "aten::constant_pad_nd"),
    # cache slots: the block offset taken as the block
    ("cache write offset slot // BS", f"{OPS}.core.ge_util",
     "ge.Pack([ge.FloorDiv(s, bs), ge.FloorMod(s, bs)], N=2, axis=1)",
     "ge.Pack([ge.FloorDiv(s, bs), ge.FloorDiv(s, bs)], N=2, axis=1)", "cp::cache_write"),
    # helpers another converter module imports (sparse.ge -> sparse.ge_dsa_cp,
    # core.ge_util -> paged.ge): each op graph below runs the importer's converter
    ("helper: DSA-CP indexer's LightningIndexer keeps topk - 1", f"{OPS}.sparse.ge",
     '"sparse_count": attr.Int(int(topk)),', '"sparse_count": attr.Int(int(topk) - 1),',
     "cp::lightning_indexer_topk_rows"),
    ("helper: GQA cache write offset slot // BS", f"{OPS}.core.ge_util",
     "ge.Pack([ge.FloorDiv(s, bs), ge.FloorMod(s, bs)], N=2, axis=1)",
     "ge.Pack([ge.FloorDiv(s, bs), ge.FloorDiv(s, bs)], N=2, axis=1)", "cp::gqa_paged_attention"),
    ("FIA's +inf empty-row LSE kept (fia_lse, in paged/ge.py since the family move)", f"{OPS}.paged.ge",
     'return where(ge.Equal(lse, const(float("inf"), F32)), const(float("-inf"), F32), lse)', "return lse",
     "cp::paged_attention_lse"),
    # inputs (issue 35 item 8): these passed while the op graphs' block table and sparse
    # indices were all zero; the shuffled table and distinct top-k indices catch them.
    ("block table gathered transposed (token reads column req)", f"{OPS}.paged.ge",
     "ge.GatherV2(cast(block_table, I32), req, const(0, I64))",
     "ge.GatherV2(ge.TransposeD(cast(block_table, I32), perm=[1, 0]), req, const(0, I64))",
     "cp::paged_attention_lse"),
    ("every request reads block-table row 0", f"{OPS}.paged.ge",
     "ge.GatherV2(cast(block_table, I32), req, const(0, I64))",
     "ge.GatherV2(cast(block_table, I32), ge.ZerosLike(req), const(0, I64))", "cp::paged_attention_lse"),
    ("sparse MLA's SparseFlashAttention drops the last top-k index", f"{OPS}.sparse.ge",
     '"sparse_indices": reshape(cast(indices, I32), [T, 1, K]),',
     '"sparse_indices": reshape(cast(ge.Slice(indices, const([0, 0], I64), const([-1, K - 1], I64)), I32), '
     '[T, 1, K - 1]),', "cp::sparse_mla_attention"),
    ("DSA-CP rows attention's SparseFlashAttention drops the last top-k index", f"{OPS}.sparse.ge_dsa_cp",
     '"sparse_indices": reshape(cast(indices, I32), [T, 1, K]),',
     '"sparse_indices": reshape(cast(ge.Slice(indices, const([0, 0], I64), const([-1, K - 1], I64)), I32), '
     '[T, 1, K - 1]),', "cp::sparse_mla_rows_attention"),
    # inputs (issue 35): passed while the indexers' index cache was all zero (every score
    # tied, the top-k the first positions whichever pages were read); the random cache
    # catches it. LightningIndexer's helper is shared; the DSA-CP rows op is the one that
    # passed (the single-device indexer's own cache write already showed it).
    ("LightningIndexer: every request reads block-table row 0", f"{OPS}.sparse.ge",
     '"actual_seq_lengths_key": key_lens,\n            "block_table": cast(block_table, I32),',
     '"actual_seq_lengths_key": key_lens,\n            "block_table": ge.GatherV2(cast(block_table, I32), '
     'ge.ZerosLike(key_lens), const(0, I64)),', "cp::lightning_indexer_topk_rows"),
    # The quantised KV cache (issue 39, decision 70): int8 pages, per-token per-head scales
    # that differ by head, so reading another head's or the key's scale changes values.
    ("int8 GQA partial: scales reshaped, not transposed, to (blocknum, N, blocksize) (another head's scale)",
     f"{OPS}.paged.ge", "return (ge.TransposeD(k_scale_cache, perm=[0, 2, 1]),",
     "return (reshape(k_scale_cache, [dims(k_scale_cache)[0], k_scale_cache.meta.shape[2], "
     "k_scale_cache.meta.shape[1]]),", "cp::paged_attention_lse[int8]"),
    ("int8 GQA partial: values dequantised with the key's scales", f"{OPS}.paged.ge",
     "ge.TransposeD(v_scale_cache, perm=[0, 2, 1]),", "ge.TransposeD(k_scale_cache, perm=[0, 2, 1]),",
     "cp::paged_attention_lse[int8]"),
    ("int8 MLA partial: scales dropped (ones: the codes read as values)", f"{OPS}.paged.ge",
     "return flat, flat, PER_TOKEN_PAGED", "return ge.OnesLike(flat), ge.OnesLike(flat), PER_TOKEN_PAGED",
     "cp::mla_partial_attention[int8]"),
    ("int8 GQA single-device op: no antiquant inputs to FIA", f"{OPS}.paged.ge",
     "antiquant = gqa_scales(k_scale_cache, v_scale_cache)", "antiquant = None", "cp::gqa_paged_attention_quant"),
    ("int8 write: scale amax instead of amax / 127", f"{OPS}.core.ge_kv_quant",
     "ge.RealDiv(amax, const(INT8_QMAX, F32))", "amax", "cp::quant_cache_write"),
    ("helper: int8 write truncates instead of rounding half to even", f"{OPS}.core.ge_kv_quant",
     "ge.ClipByValue(ge.Round(y),", "ge.ClipByValue(y,", "cp::mla_attention_quant"),
    ("int8 SFA partial: gathered codes not multiplied by their scales", f"{OPS}.sparse.ge_quant",
     "ge.Mul(ge.Cast(codes, dst_type=F32), scales)", "ge.Cast(codes, dst_type=F32)",
     "cp::sparse_mla_partial_attention[int8]"),
    ("int8 SFA single-device op: each row dequantised with its page's first slot's scale", f"{OPS}.sparse.ge_quant",
     "scales = ge.GatherNd(kv_scale_cache, at)",
     "scales = ge.GatherNd(kv_scale_cache, ge.Pack([block, ge.Mul(block, const(0, I64))], N=2, axis=2))",
     "cp::sparse_mla_attention_quant"),
]


CONTROL = "control: the library's converters, after every mutation"


@pytest.fixture(scope="module")
def mutated_checks(torchair_python: str, tmp_path_factory) -> dict:
    """Every mutation checked by one process in turn (`--mutations`), then the
    library's converters (old text ""): they must pass, so a mutation's failure is its
    own and not left over from the ones before it. The check applies the rows and
    reports those whose text is not in their module exactly once."""
    root = tmp_path_factory.mktemp("mutations")
    spec = [list(m) for m in MUTATIONS] + [[CONTROL, f"{OPS}.paged.ge_cache", "", "", "cp::cache_write"]]
    (root / "spec.json").write_text(json.dumps(spec))
    rc, data, output = run_check(torchair_python, root / "m.json", "--mutations", str(root / "spec.json"))
    missing = data.get("summary", {}).get("mutations_not_applied", {})
    runs = {row[0]: [r for r in data.get("results", []) if r["mutation"] == row[0]] for row in spec}
    if os.environ.get("CP_COMPILE_GE_MUTATIONS_JSON"):  # the mutation table of docs / notes
        table = {name: [(r["name"], r["status"], r["message"][:400]) for r in rs] for name, rs in runs.items()}
        with open(os.environ["CP_COMPILE_GE_MUTATIONS_JSON"], "w") as f:
            json.dump(dict(table=table, seconds=data.get("summary", {}).get("seconds")), f, indent=1)
    return dict(runs=runs, missing=missing, output=output)


def test_control_copy_passes(mutated_checks: dict) -> None:
    (control,) = mutated_checks["runs"][CONTROL] or [None]
    assert control is not None and control["status"] == "ok", mutated_checks["output"]


@pytest.mark.parametrize("name,module,old,new,op", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_value_check_fails_on_a_wrong_converter(mutated_checks: dict, name: str, module: str, old: str, new: str,
                                                op: str) -> None:
    assert name not in mutated_checks["missing"], f"mutation {name!r}: {mutated_checks['missing'].get(name)}"
    runs = mutated_checks["runs"][name]
    assert len(runs) == 1, f"mutation {name!r}: expected one op graph, got {runs}\n{mutated_checks['output']}"
    (bad,) = runs
    assert bad["status"] != "ok", f"mutation {name!r} passed the check:\n{mutated_checks['output']}"
    assert bad["name"] == f"op:{op}", bad
    assert bad["message"], bad
