"""The GE value check catches wrong converters (docs/torchair.md, tools/ge_eval).

Each case copies the converter modules (`catalog.converter_modules()`: every family's
`ge*.py` and core's GE helpers, at their paths below ops/) to a temporary folder, breaks one
converter there the way a reviewer would, and the check runs that op's graph with the
copy registered in place of the library's (one check process runs every copy in turn,
`--mutations`, and an unmutated copy last, which must pass): the check must fail and
name the op. The first three are the mutations that passed the
structure-only check before the value check existed.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from cp_compile.ops.core.catalog import converter_modules, module_path
from tests.ops.conftest import REPO, run_check

# (id, file, text, replacement, op graph that must fail)
MUTATIONS = [
    ("lse_rescale weights exp(total - mine)", "merge/ge.py", "ge.Exp(ge.Sub(mine, total))",
     "ge.Exp(ge.Sub(total, mine))", "cp::lse_rescale"),
    ("k and v caches swapped in the GQA partial's FIA", "paged/ge.py", "query, [k_cache], [v_cache], None",
     "query, [v_cache], [k_cache], None", "cp::paged_attention_lse"),
    ("localisation compares the owner with 0, not the rank", "paged/ge_cache.py", "ge.Equal(owner, const(rank, I64))",
     "ge.Equal(owner, const(0, I64))", "cp::dcp_localize_metadata"),
    # lengths: the single-device causal length one short
    ("causal length pos instead of pos + 1", "paged/ge.py",
     "return where(valid, ge.Add(pos, const(1, I64)), const(0, I64))", "return where(valid, pos, const(0, I64))",
     "cp::gqa_paged_attention"),
    # head counts: FIA told one kv head for a two-kv-head cache
    ("num_key_value_heads 1 for Hkv = 2", "paged/ge.py", "heads=int(H), kv_heads=Hkv,",
     "heads=int(H), kv_heads=1,", "cp::paged_attention_lse"),
    # ranks: the DSA-CP row shard computed for rank 0 on rank 1
    ("DSA-CP indexer shard of rank 0", "sparse/ge_dsa_cp.py", "cum, k, real = _shard_tnd(q_i, query_start_loc, seq_lens, rank)",
     "cum, k, real = _shard_tnd(q_i, query_start_loc, seq_lens, 0)", "cp::lightning_indexer_topk_rows"),
    # groups: the A2A merge pairs rank i's LSE with rank N-1-i's output
    ("AttentionUpdate partials out of order", "merge/ge.py",
     "go = [reshape(x, [-1, dv]) for x in ge.SplitD(outs, split_dim=0, num_split=n)]",
     "go = [reshape(x, [-1, dv]) for x in ge.SplitD(outs, split_dim=0, num_split=n)][::-1]", "cp::lse_combine"),
    # groups: one activation scale for every W8A8 input group
    ("W8A8 static scale of group 0 for all groups", "quant/ge.py",
     "s = reshape(cast(input_scale, F32), [1, groups, 1])",
     "s = ge.ReduceMaxD(reshape(cast(input_scale, F32), [1, groups, 1]), axes=[1], keep_dims=True)",
     "cp::w8a8_static_linear"),
    # cache slots: the GE cache write before issue 21's scratch block, slot -1 -> block -1
    # (CANN: out-of-range ScatterNdUpdate indices unsupported; the evaluator refuses them)
    ("slot -1 written as block -1 (no scratch block)", "core/ge_util.py",
     "s = where(ge.GreaterEqual(s, const(0, I64)), s, scratch_slot(cache))", "s = s", "cp::cache_write"),
    # layouts: PadV3's paddings in torch's order (last dim first), the DSA-CP token pad's converter
    ("PadV3 paddings not reordered to dim-0-first", "core/ge_aten_pad.py",
     "const(padv3_order(self.rank, int(pad_len)), I64)", "const(padv3_order(self.rank, int(pad_len))[::-1], I64)",
     "aten::constant_pad_nd"),
    # cache slots: the block offset taken as the block
    ("cache write offset slot // BS", "core/ge_util.py", "ge.Pack([ge.FloorDiv(s, bs), ge.FloorMod(s, bs)], N=2, axis=1)",
     "ge.Pack([ge.FloorDiv(s, bs), ge.FloorDiv(s, bs)], N=2, axis=1)", "cp::cache_write"),
]


CONTROL = "control: the library's converters, after every mutation"


@pytest.fixture(scope="module")
def mutated_checks(torchair_python: str, tmp_path_factory) -> dict:
    """Every mutation in its own copy of the converter modules, all checked by one process in turn
    (`--mutations`), then an unmutated copy: it must pass, so a mutation's failure is
    its own and not left over from the ones before it."""
    root = tmp_path_factory.mktemp("mutations")
    spec, missing = [], []
    for k, (name, file, old, new, op) in enumerate(MUTATIONS + [(CONTROL, "paged/ge_cache.py", "", "", "cp::cache_write")]):
        folder = root / f"mut{k}" / "ops"
        for module in converter_modules():  # each at its path below ops/ (tools/ge_check.load_converters)
            (folder / module_path(module)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / "ops" / module_path(module), folder / module_path(module))
        source = (folder / file).read_text()
        if old and source.count(old) != 1:
            missing.append(name)
            continue
        (folder / file).write_text(source.replace(old, new) if old else source)
        spec.append([name, str(folder), op])
    (root / "spec.json").write_text(json.dumps(spec))
    rc, data, output = run_check(torchair_python, root / "m.json", "--mutations", str(root / "spec.json"))
    runs = {name: [r for r in data.get("results", []) if r["mutation"] == name] for name, _, _ in spec}
    if os.environ.get("CP_COMPILE_GE_MUTATIONS_JSON"):  # the mutation table of docs / notes
        table = {name: [(r["name"], r["status"], r["message"][:400]) for r in rs] for name, rs in runs.items()}
        with open(os.environ["CP_COMPILE_GE_MUTATIONS_JSON"], "w") as f:
            json.dump(dict(table=table, seconds=data.get("summary", {}).get("seconds")), f, indent=1)
    return dict(runs=runs, missing=missing, output=output)


def test_control_copy_passes(mutated_checks: dict) -> None:
    (control,) = mutated_checks["runs"][CONTROL] or [None]
    assert control is not None and control["status"] == "ok", mutated_checks["output"]


@pytest.mark.parametrize("name,file,old,new,op", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_value_check_fails_on_a_wrong_converter(mutated_checks: dict, name, file, old, new, op) -> None:
    assert name not in mutated_checks["missing"], f"mutation {name!r}: {old!r} must occur once in ops/{file}"
    runs = mutated_checks["runs"][name]
    assert len(runs) == 1, f"mutation {name!r}: expected one op graph, got {runs}\n{mutated_checks['output']}"
    (bad,) = runs
    assert bad["status"] != "ok", f"mutation {name!r} passed the check:\n{mutated_checks['output']}"
    assert bad["name"] == f"op:{op}", bad
    assert bad["message"], bad
