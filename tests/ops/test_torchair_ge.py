"""torchair GE graph mode without an NPU (tools/ge_check/, docs/torchair.md).

The check runs in its own environment (.venv-torchair: CPU torch + torch-npu's
torchair, whose one C++ extension is replaced by tools.torchair_standin)
as a subprocess: every cp:: op and the DCP-rewritten example models (GQA and MLA,
tp = 4 on 4 gloo ranks, dcp 1 and 2, both merges; the sparse SFA model at tp = dcp = 2
on 2 ranks) go through torchair's real
FX -> GE conversion in max-autotune mode; the GE graphs handed to the stand-in's
`load` must hold the expected CANN ops, attributes and HCCL groups, and, run on CPU
by tools/ge_eval, compute what the FX graph computes (outputs and caches, every rank,
both readings of FIA's empty-row LSE). An op without a converter must fail the check.
"""

from __future__ import annotations

from pathlib import Path

from tests.ops.conftest import REPO, run_check  # noqa: F401  (fixtures: torchair_python, check)


def test_every_cp_op_converts_to_ge(check, summary_note) -> None:
    rc, data, output = check
    failed = [f"{r['name']}: {r['message']}" for r in data.get("results", []) if r["status"] != "ok"]
    assert rc == 0 and not failed, output + "\n\n" + "\n\n".join(failed)
    s = data["summary"]
    assert s["cp_ops_without_converter"] == [] and s["cp_ops_defined"] == s["op_graphs"] >= 11
    assert s["op_graph_variants"] == 4  # the four partials over an int8 cache (below; two SFA)
    ops = {r["name"][3:]: r for r in data["results"] if r["name"].startswith("op:")}
    fia = {op: r["attrs"]["FusedInferAttentionScore"][0] for op, r in ops.items()
           if "FusedInferAttentionScore" in r["attrs"]}
    assert fia["cp::paged_attention_lse"] == dict(num_heads=8, num_key_value_heads=2, input_layout="BSND",
                                                  softmax_lse_flag=True, block_size=4, sparse_mode=0, scale=0.125,
                                                  key_antiquant_mode=0, value_antiquant_mode=0)
    assert fia["cp::mla_partial_attention"]["num_key_value_heads"] == 1
    assert ops["cp::lse_combine"]["attrs"]["AttentionUpdate"] == [{"update_type": 1, "sp": 2}]
    assert ops["cp::cache_write"]["ge_ops"]["ScatterNdUpdate"] == 1
    assert ops["cp::gqa_paged_attention"]["ge_ops"]["ScatterNdUpdate"] == 2  # k and v (slot -1: no ScatterPaKvCache)
    # Slot -1 goes to the caches' scratch block (the evaluator refuses out-of-range
    # indices), and its undefined content is the one part of a cache not compared.
    assert any("scratch block not compared" in v["what"] for v in ops["cp::cache_write"]["values"])
    # The symbolic-pad converter of the DSA-CP token pad (ops/core/ge_aten_pad.py), by value.
    assert ops["aten::constant_pad_nd"]["ge_ops"]["PadV3"] == 1 and s["aten_op_graphs"] == 1
    assert ops["cp::lightning_indexer"]["attrs"]["LightningIndexer"][0]["sparse_count"] == 4
    assert ops["cp::sparse_mla_attention"]["ge_ops"]["SparseFlashAttention"] == 1
    # What GE is handed: the bf16 query and paged caches in, the bf16 output and fp32 LSE out.
    io = ops["cp::paged_attention_lse"]["io"]
    assert io["inputs"][:3] == ["y: DT_BF16[6, 8, 64]", "y: DT_BF16[8, 4, 2, 64]", "y: DT_BF16[8, 4, 2, 64]"], io
    assert io["outputs"] == ["input0: DT_BF16[6, 8, 64]", "input1: DT_FLOAT[6, 8]"], io
    summary_note(f"torchair GE check (torchair of torch-npu 2.13.0, only its C++ extension stood in): "
                 f"{s['op_graphs']} op graphs + {s['model_graphs']} DCP model graphs (GQA / MLA, every rank "
                 f"of 4 gloo ranks; SFA on 2), "
                 f"{s['fx_nodes']} FX nodes -> {s['ge_ops']} GE ops ({s['hccl_ops']} HCCL), all converted, "
                 f"GE == FX by value, "
                 f"{s['seconds']:.1f} s (.venv-torchair/bin/python -m tools.ge_check prints the table)")


# The quantised KV cache's graphs (issue 39, decision 70): op graph -> (FIA antiquant mode, the
# GE ops it must hold, how many compared tensors: outputs + mutated caches).
QUANT_GRAPHS = {
    "cp::quant_cache_write": (None, ("ReduceMaxD", "Round", "ClipByValue", "ScatterNdUpdate"), 2),
    "cp::paged_attention_lse[int8]": (5, ("TransposeD", "FusedInferAttentionScore"), 2),
    "cp::mla_partial_attention[int8]": (4, ("FusedInferAttentionScore",), 2),
    "cp::gqa_paged_attention_quant": (5, ("Round", "ScatterNdUpdate", "TransposeD", "FusedInferAttentionScore"), 5),
    "cp::mla_attention_quant": (4, ("Round", "ScatterNdUpdate", "FusedInferAttentionScore"), 3),
    # SFA over an int8 latent (decision 75): no antiquant input; the listed rows gathered and
    # dequantised (GatherNd, Cast, Mul) before SparseFlashAttention, compared at bf16's tolerance
    # (its key / value are in the query's dtype: tools/ge_check/op_graphs.BF16_PATHS).
    "cp::sparse_mla_partial_attention[int8]": (None, ("GatherNd", "Mul", "SparseFlashAttention"), 2),
    "cp::sparse_mla_rows_attention[int8]": (None, ("GatherNd", "Mul", "SparseFlashAttention"), 1),
    "cp::sparse_mla_attention_quant": (None, ("Round", "ScatterNdUpdate", "GatherNd", "SparseFlashAttention"), 3),
}


def test_quantised_kv_graphs_equal_fx_by_value(check, summary_note) -> None:
    """int8 pages and fp32 per-token scales: the write's quantisation and scatters, and FIA's
    page-managed per-token antiquant scales (mode 5 GQA, 4 MLA), equal the FX graph (the
    reference kernels) by value: outputs, and the written codes (exactly) and scales."""
    rc, data, output = check
    ops = {r["name"][3:]: r for r in data.get("results", []) if r["name"].startswith("op:")}
    rows = []
    for name, (mode, ge_ops, compared) in QUANT_GRAPHS.items():
        r = ops.get(name)
        assert r is not None, f"no op graph {name}:\n{output}"
        assert r["status"] == "ok", (name, r["message"])
        assert all(r["ge_ops"].get(t) for t in ge_ops), (name, r["ge_ops"])
        fia = r["attrs"].get("FusedInferAttentionScore", [])
        if mode is not None:
            assert [(f["key_antiquant_mode"], f["value_antiquant_mode"]) for f in fia] == [(mode, mode)], fia
        io = r["io"]["inputs"]
        assert any("DT_INT8" in x for x in io), io  # GE is handed the int8 pages
        checked = {v["what"] for v in r["values"]}
        assert len(checked) >= compared and all(v["ok"] for v in r["values"]), (name, r["values"])
        ints = [v for v in r["values"] if v["dtype"] == "int8"]
        reads_only = ("cp::paged", "cp::mla_partial", "cp::sparse_mla_partial", "cp::sparse_mla_rows")
        assert name.startswith(reads_only) or (ints and all(v["max_abs_diff"] == 0 for v in ints)), r["values"]
        rows.append(f"{name} {max(v['max_abs_diff'] for v in r['values']):.2g}")
    # The DCP pass's quantised compositions in the example models (tp 4, dcp 2, every rank): codes
    # written on their owner exactly as the FX graph writes them, logits within bf16's tolerance.
    models = [r for r in data.get("results", []) if r["name"].endswith(" int8")]
    # (MLA's a2a int8 model graph is run by hand: tools/ge_check/model_graphs.BY_HAND_CONFIGS)
    assert sorted({r["name"] for r in models}) == ["gqa tp=4 dcp=2 ag_rs int8"], output
    for r in models:
        assert r["status"] == "ok" and r["values"] and all(v["ok"] for v in r["values"]), (r["name"], r["message"])
        codes = [v for v in r["values"] if v["dtype"] == "int8"]
        assert codes and all(v["max_abs_diff"] == 0 for v in codes), r["values"]
    worst = max(v["max_abs_diff"] for r in models for v in r["values"])
    summary_note("quantised KV GE graphs == FX by value (max abs diff): " + ", ".join(rows) +
                 f"; int8 DCP model graph (GQA ag_rs; 4 ranks) {worst:.2g}")


def test_dcp_model_graphs_use_hccl_on_the_dcp_group(check) -> None:
    rc, data, output = check
    models = [r for r in data.get("results", []) if not r["name"].startswith(("op:", "sfa "))]
    names = {(r["name"], r["rank"]) for r in models}
    want = {f"{m} tp=4 dcp={d}" for m in ("gqa", "mla") for d in ("1", "2 ag_rs", "2 a2a")}
    want |= {"gqa tp=4 dcp=2 ag_rs int8"}  # quantised KV cache (decision 70; MLA's by hand)
    assert names == {(n, rank) for n in want for rank in range(4)}, output
    for r in models:
        assert r["status"] == "ok", (r["name"], r["message"])
        assert not any("NO CONVERTER" in t for t in r["fx_targets"]), r["fx_targets"]
        assert r["fx_nodes"] > 50 and r["ge_ops"]["FusedInferAttentionScore"] == 1
        assert r["tp_ranks"] == [0, 1, 2, 3]
        assert all(g["rank_list"] == [0, 1, 2, 3] for g in r["groups"] if g["type"] == "HcomAllReduce"), r["groups"]
        dcp_ops = [g for g in r["groups"] if g["type"] != "HcomAllReduce"]
        if "dcp=1" in r["name"]:
            assert dcp_ops == []
            continue
        dcp_group = [0, 1] if r["rank"] < 2 else [2, 3]
        assert r["expected_ranks"] == dcp_group
        for g in dcp_ops:
            assert g["rank_list"] == dcp_group and g["group"].startswith("tag=ptd:"), g
        kinds = {g["type"] for g in dcp_ops}
        assert kinds == ({"HcomAllGather", "HcomReduceScatter"} if "ag_rs" in r["name"]
                         else {"HcomAllGather", "HcomAllToAllV"}), kinds
        # The TP all-reduce and the DCP collectives are on different groups (ranks 0-3 vs 0-1).
        tp = {g["group"] for g in r["groups"] if g["type"] == "HcomAllReduce"}
        assert tp and not tp & {g["group"] for g in dcp_ops}


def test_sfa_model_graph_keeps_the_indexer_and_attends_sparse(check) -> None:
    """SFA DCP (tp = dcp = 2): LightningIndexer over the replicated cache, the top-k
    remap (stable Sort), SparseFlashAttention with its LSE, collectives on the DCP group."""
    rc, data, output = check
    sfa = [r for r in data.get("results", []) if r["name"].startswith("sfa ") and "dcp=2" in r["name"]]
    assert {(r["name"], r["rank"]) for r in sfa} == {("sfa tp=2 dcp=2 ag_rs", rank) for rank in (0, 1)}, output
    for r in sfa:
        assert r["status"] == "ok", (r["name"], r["message"])
        ops = r["ge_ops"]
        assert (ops["LightningIndexer"], ops["SparseFlashAttention"], ops["Sort"], ops["ScatterNdUpdate"]) == \
            (1, 1, 1, 2), ops
        assert "FusedInferAttentionScore" not in ops
        assert r["attrs"]["SparseFlashAttention"][0]["return_softmax_lse"] is True
        assert r["expected_ranks"] == [0, 1] and all(g["rank_list"] == [0, 1] for g in r["groups"]), r["groups"]
        assert {g["type"] for g in r["groups"]} == {"HcomAllGather", "HcomReduceScatter", "HcomAllReduce"}


def test_dsa_cp_prefill_graph_lowers_without_recompiling(check) -> None:
    """The DSA-CP prefill graph (tp = 2, W8A8 o_proj pass): its symbolic token pad lowers
    (PadV3, ops/core/ge_aten_pad.py), a second step of the other token-count parity reuses
    the graph (error_on_recompile), and both steps' GE values equal FX on both ranks."""
    rc, data, output = check
    dsa = [r for r in data.get("results", []) if r["name"] == "sfa tp=2 dcp=1 dsa_cp"]
    assert sorted(r["rank"] for r in dsa) == [0, 1], output
    for r in dsa:
        assert r["status"] == "ok", (r["rank"], r["message"])
        assert r["ge_ops"].get("PadV3") and r["ge_ops"].get("QuantBatchMatmulV3"), r["ge_ops"]
        outputs = [v for v in r["values"] if v["what"] == "output 0"]
        assert len(outputs) == 4 and all(v["ok"] for v in r["values"])  # 2 steps x 2 FIA-LSE readings


def test_an_op_without_converter_fails_the_check(torchair_python: str, tmp_path: Path) -> None:
    rc, data, output = run_check(torchair_python, tmp_path / "neg.json", "--with-unconverted-op", "--op", "cp::cache_write")
    assert rc == 1, output
    (bad,) = [r for r in data["results"] if r["status"] != "ok"]
    assert bad["name"] == "op:cp_check::unconverted"
    # torchair found no converter, tried to generate one, and CANN's IR registry (the
    # stand-in's, which knows only the ops in CANN_IR_TYPES) has no op "Unconverted".
    assert "No AscendIR Unconverted was found to be registered" in bad["message"], bad["message"]
    assert all(r["status"] == "ok" for r in data["results"] if r is not bad)


def test_ge_graphs_equal_fx_graphs_by_value(check) -> None:
    """Every op graph and every model graph on every rank: outputs and mutated caches
    compared under both readings of FIA's empty-row LSE, all within tolerance."""
    rc, data, output = check
    results = data.get("results", [])
    for r in results:
        assert r["status"] == "ok", (r["name"], r["rank"], r["message"])
        variants = {v["variant"] for v in r["values"]}
        assert variants == {"fia_empty_lse=-inf", "fia_empty_lse=+inf"}, (r["name"], variants)
        assert all(v["ok"] for v in r["values"]) and any(v["what"].startswith("output") for v in r["values"]), r
    # The caches come back written: a mutated input was compared in every cache-writing graph.
    writers = [r for r in results if r["name"] in ("op:cp::cache_write", "op:cp::gqa_paged_attention")
               or not r["name"].startswith("op:")]
    assert all(any("mutated" in v["what"] for v in r["values"]) for r in writers)
    # The -1 slots go to the caches' scratch block, in range (the evaluator refuses an
    # out-of-range index). Where several land on its one slot (every model graph: padding,
    # other ranks' tokens), the evaluator leaves NaN there, and the outputs still match:
    # no attention read the scratch block.
    cache_write = next(r for r in results if r["name"] == "op:cp::cache_write")
    assert cache_write["uncertain"] == {}, cache_write["uncertain"]  # one -1 row: nothing undefined
    models = [r for r in results if not r["name"].startswith("op:")]
    assert models and all(any("several rows" in k for k in r["uncertain"]) for r in models), \
        [(r["name"], r["rank"], r["uncertain"]) for r in models]


# The W8A8 linears (ops/quant/ge.py): int8 x int8 -> int32 in QuantBatchMatmulV3,
# per-group activation quantisation and fp32 dequantisation in GE primitives, the model
# dtype in and out; and, evaluated on CPU, equal to the FX graph (was test_quant_ge.py:
# one file per check run, so pytest-xdist's loadfile runs it in one worker).
def test_w8a8_linears_convert_to_ge(check) -> None:
    rc, data, output = check
    ops = {r["name"]: r for r in data.get("results", []) if "w8a8" in r["name"]}
    assert set(ops) == {"op:cp::w8a8_dynamic_linear", "op:cp::w8a8_static_linear"}, output
    for name, r in ops.items():
        assert r["status"] == "ok", (name, r["message"])
        assert r["ge_ops"]["QuantBatchMatmulV3"] == 1 and r["ge_ops"]["Round"] == 1, r["ge_ops"]
        assert r["io"]["outputs"] == ["input0: DT_BF16[6, 32]"], r["io"]
        assert r["io"]["inputs"][1] == "y: DT_INT8[64, 32]", r["io"]  # the K-major int8 weight, as given
        assert r["values"] and all(v["ok"] for v in r["values"]), r["values"]  # GE == FX by value
    assert ops["op:cp::w8a8_dynamic_linear"]["ge_ops"]["ReduceMaxD"] == 1  # the per-token amax
    assert "y: DT_INT32[2, 32]" in ops["op:cp::w8a8_static_linear"]["io"]["inputs"]  # the quant bias, per group
    assert data["summary"]["cp_ops_without_converter"] == []
