"""The GE value check catches wrong converters (docs/torchair.md, tools/ge_eval).

Each case copies the converter modules (ops/ge/*.py) to a temporary folder, breaks one
converter there the way a reviewer would, and runs the check on that op's graph with
the copy loaded in place of the library's (`CP_COMPILE_GE_CONVERTERS`): the check
must fail and name the op. The first three are the mutations that passed the
structure-only check before the value check existed.
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.ops.conftest import REPO, run_check

# (id, file, text, replacement, op graph that must fail)
MUTATIONS = [
    ("lse_rescale weights exp(total - mine)", "merge.py", "ge.Exp(ge.Sub(mine, total))",
     "ge.Exp(ge.Sub(total, mine))", "cp::lse_rescale"),
    ("k and v caches swapped in the GQA partial's FIA", "attention.py", "query, [k_cache], [v_cache], None",
     "query, [v_cache], [k_cache], None", "cp::paged_attention_lse"),
    ("localisation compares the owner with 0, not the rank", "cache.py", "ge.Equal(owner, const(rank, I64))",
     "ge.Equal(owner, const(0, I64))", "cp::dcp_localize_metadata"),
    # lengths: the single-device causal length one short
    ("causal length pos instead of pos + 1", "attention.py",
     "return where(valid, ge.Add(pos, const(1, I64)), const(0, I64))", "return where(valid, pos, const(0, I64))",
     "cp::gqa_paged_attention"),
    # head counts: FIA told one kv head for a two-kv-head cache
    ("num_key_value_heads 1 for Hkv = 2", "attention.py", "heads=int(H), kv_heads=Hkv,",
     "heads=int(H), kv_heads=1,", "cp::paged_attention_lse"),
    # layouts: the varlen attention's TND queries declared BSND
    ("varlen attention layout BSND", "attention.py", 'next_tokens=0, input_layout="TND"',
     'next_tokens=0, input_layout="BSND"', "cp::varlen_causal_attention_lse"),
    # ranks: the DSA-CP row shard computed for rank 0 on rank 1
    ("DSA-CP indexer shard of rank 0", "dsa_cp.py", "cum, k, real = _shard_tnd(q_i, query_start_loc, seq_lens, rank)",
     "cum, k, real = _shard_tnd(q_i, query_start_loc, seq_lens, 0)", "cp::lightning_indexer_topk_rows"),
    # groups: the A2A merge pairs rank i's LSE with rank N-1-i's output
    ("AttentionUpdate partials out of order", "merge.py",
     "go = [reshape(x, [-1, dv]) for x in ge.SplitD(outs, split_dim=0, num_split=n)]",
     "go = [reshape(x, [-1, dv]) for x in ge.SplitD(outs, split_dim=0, num_split=n)][::-1]", "cp::lse_combine"),
    # groups: one activation scale for every W8A8 input group
    ("W8A8 static scale of group 0 for all groups", "quant.py",
     "s = reshape(cast(input_scale, F32), [1, groups, 1])",
     "s = ge.ReduceMaxD(reshape(cast(input_scale, F32), [1, groups, 1]), axes=[1], keep_dims=True)",
     "cp::w8a8_static_linear"),
    # cache slots: the GE cache write before issue 21's scratch block, slot -1 -> block -1
    # (CANN: out-of-range ScatterNdUpdate indices unsupported; the evaluator refuses them)
    ("slot -1 written as block -1 (no scratch block)", "cache.py",
     "s = where(ge.GreaterEqual(s, const(0, I64)), s, scratch_slot(cache))", "s = s", "cp::cache_write"),
    # layouts: PadV3's paddings in torch's order (last dim first), the DSA-CP token pad's converter
    ("PadV3 paddings not reordered to dim-0-first", "aten_pad.py",
     "const(padv3_order(self.rank, int(pad_len)), I64)", "const(padv3_order(self.rank, int(pad_len))[::-1], I64)",
     "aten::constant_pad_nd"),
    # cache slots: the block offset taken as the block
    ("cache write offset slot // BS", "cache.py", "ge.Pack([ge.FloorDiv(s, bs), ge.FloorMod(s, bs)], N=2, axis=1)",
     "ge.Pack([ge.FloorDiv(s, bs), ge.FloorDiv(s, bs)], N=2, axis=1)", "cp::cache_write"),
]


@pytest.fixture(scope="module")
def mutated_checks(torchair_python: str, tmp_path_factory) -> dict:
    """Each mutation in its own copy and check process, two at a time (the CI machine's cores)."""
    def one(k: int):
        name, file, old, new, op = MUTATIONS[k]
        folder = tmp_path_factory.mktemp(f"mut{k}") / "ge"
        shutil.copytree(REPO / "ops" / "ge", folder)
        source = (folder / file).read_text()
        if source.count(old) != 1:
            return None
        (folder / file).write_text(source.replace(old, new))
        return run_check(torchair_python, folder.parent / "m.json", "--op", op,
                         env={"CP_COMPILE_GE_CONVERTERS": str(folder)})

    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip((m[0] for m in MUTATIONS), pool.map(one, range(len(MUTATIONS)))))
    if os.environ.get("CP_COMPILE_GE_MUTATIONS_JSON"):  # the mutation table of docs / notes
        table = {name: None if run is None else dict(rc=run[0], failed=[(r["name"], r["message"][:400]) for r in
                                                                        run[1].get("results", []) if r["status"] != "ok"])
                 for name, run in runs.items()}
        with open(os.environ["CP_COMPILE_GE_MUTATIONS_JSON"], "w") as f:
            json.dump(table, f, indent=1)
    return runs


@pytest.mark.parametrize("name,file,old,new,op", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_value_check_fails_on_a_wrong_converter(mutated_checks: dict, name, file, old, new, op) -> None:
    assert mutated_checks[name] is not None, f"mutation {name!r}: {old!r} must occur once in ops/ge/{file}"
    rc, data, output = mutated_checks[name]
    assert rc == 1, f"mutation {name!r} passed the check:\n{output}"
    (bad,) = [r for r in data["results"] if r["status"] != "ok"]
    assert bad["name"] == f"op:{op}", bad
    assert bad["message"], bad
