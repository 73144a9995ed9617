"""Every rule of docs/architecture.md §7, both ways: a valid config passes, a broken one raises
`cp_compile.ConfigError` naming the rule and the offending values (and a fix)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

import cp_compile
from cp_compile import AttentionSpec, ConfigError, CPConfig

MLA = AttentionSpec("mla", num_heads=128)
SFA = AttentionSpec("sfa", num_heads=64, has_indexer=True)


def gqa(num_kv_heads: int, num_heads: int = 64) -> AttentionSpec:
    return AttentionSpec("gqa", num_heads=num_heads, num_kv_heads=num_kv_heads)


@contextmanager
def raises(rule: str, *values: str):
    """The block raises ConfigError naming `rule`, every value in `values`, and a fix."""
    with pytest.raises(ConfigError) as excinfo:
        yield
    msg = str(excinfo.value)
    assert excinfo.value.rule == rule, msg
    assert rule in msg, msg
    for v in values:
        assert v in msg, (v, msg)
    assert "Fix:" in msg, msg


def test_public_api_and_error_type():
    assert cp_compile.ConfigError is ConfigError
    assert issubclass(ConfigError, ValueError)
    cfg = CPConfig()
    assert (cfg.tensor_parallel_size, cfg.decode_context_parallel_size, cfg.prefill_context_parallel_size,
            cfg.cp_kv_cache_interleave_size, cfg.block_size) == (1, 1, 1, 1, 128)
    # One name per field: the short aliases (tp, dcp, pcp, interleave) are gone (issue 20).
    assert not any(hasattr(cfg, a) for a in ("tp", "dcp", "pcp", "interleave"))
    cfg = CPConfig(tensor_parallel_size=8, decode_context_parallel_size=4,
                   prefill_context_parallel_size=2, cp_kv_cache_interleave_size=16, block_size=64)
    assert (cfg.tensor_parallel_size, cfg.decode_context_parallel_size, cfg.prefill_context_parallel_size,
            cfg.cp_kv_cache_interleave_size) == (8, 4, 2, 16)
    assert cfg.world_size == 16
    assert cfg.virtual_block_size == 64 * 4 * 2  # the cache is sharded over pcp * dcp ranks (docs/pcp.md)


# --------------------------------------------------------------------- sizes >= 1


@pytest.mark.parametrize("name", ["tensor_parallel_size", "decode_context_parallel_size",
                                  "prefill_context_parallel_size", "block_size"])
@pytest.mark.parametrize("bad", [0, -2])
def test_sizes_at_least_one(name, bad):
    CPConfig(**{name: 1})
    CPConfig(**{name: 2})
    with raises(f"{name} >= 1", f"{name}={bad}"):
        CPConfig(**{name: bad})


@pytest.mark.parametrize("name", ["tensor_parallel_size", "decode_context_parallel_size", "block_size"])
def test_sizes_must_be_integers(name):
    with raises(f"{name} >= 1", f"{name}=2.0"):
        CPConfig(**{name: 2.0})


# --------------------------------------------------------------------- interleave


@pytest.mark.parametrize("bad", [0, -1])
def test_interleave_at_least_one(bad):
    CPConfig(cp_kv_cache_interleave_size=1)
    with raises("cp_kv_cache_interleave_size >= 1", f"cp_kv_cache_interleave_size={bad}"):
        CPConfig(cp_kv_cache_interleave_size=bad)


@pytest.mark.parametrize("block_size,interleave", [(128, 1), (128, 2), (128, 64), (128, 128), (16, 16), (48, 3)])
def test_interleave_divides_block_size_ok(block_size, interleave):
    CPConfig(block_size=block_size, cp_kv_cache_interleave_size=interleave)


@pytest.mark.parametrize("block_size,interleave", [(128, 3), (128, 256), (16, 12), (64, 48)])
def test_interleave_divides_block_size_violated(block_size, interleave):
    with raises("block_size % cp_kv_cache_interleave_size == 0",
                f"block_size={block_size}", f"cp_kv_cache_interleave_size={interleave}"):
        CPConfig(block_size=block_size, cp_kv_cache_interleave_size=interleave)


def test_dcp_merge_choice():
    CPConfig(dcp_merge="ag_rs")
    CPConfig(dcp_merge="a2a")
    CPConfig(dcp_merge="replicate")
    assert CPConfig().dcp_merge == "auto"
    with raises("dcp_merge is auto|ag_rs|a2a|replicate", "dcp_merge='ring'"):
        CPConfig(dcp_merge="ring")


def test_dcp_project_before_merge_choice():
    """Issue 37: auto | on | off; a bool is refused (the values are words, as dcp_merge's)."""
    assert CPConfig().dcp_project_before_merge == "auto"
    for v in ("on", "off"):
        assert CPConfig(dcp_project_before_merge=v).dcp_project_before_merge == v
    for bad in (True, "yes"):
        with raises("dcp_project_before_merge is auto|on|off", f"dcp_project_before_merge={bad!r}"):
            CPConfig(dcp_project_before_merge=bad)


def test_dcp_merge_fold_choice():
    """Decision 62: auto | on | off, default off (the fold costs weight memory the KV pool does not budget)."""
    assert CPConfig().dcp_merge_fold == "off"
    for v in ("on", "auto"):
        assert CPConfig(dcp_merge_fold=v).dcp_merge_fold == v
    for bad in (True, "yes"):
        with raises("dcp_merge_fold is auto|on|off", f"dcp_merge_fold={bad!r}"):
            CPConfig(dcp_merge_fold=bad)


def test_replace_revalidates():
    cfg = CPConfig(block_size=128, cp_kv_cache_interleave_size=64)
    assert cfg.replace(block_size=64).block_size == 64
    with raises("block_size % cp_kv_cache_interleave_size == 0", "block_size=32"):
        cfg.replace(block_size=32)


# --------------------------------------------------------------------- MLA / SFA: tp >= dcp, tp % dcp


@pytest.mark.parametrize("tp,dcp", [(1, 1), (2, 1), (2, 2), (4, 2), (8, 4), (8, 8), (16, 8), (6, 3)])
def test_mla_tp_dcp_ok(tp, dcp):
    CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp).validate_for(MLA)


@pytest.mark.parametrize("tp,dcp", [(4, 8), (1, 2), (6, 4), (8, 3)])
def test_mla_tp_dcp_violated(tp, dcp):
    with raises("tp >= dcp and tp % dcp == 0 (MLA/SFA)",
                f"tensor_parallel_size={tp}", f"decode_context_parallel_size={dcp}"):
        CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp).validate_for(MLA)


@pytest.mark.parametrize("tp,dcp", [(4, 8), (6, 4)])
def test_sfa_tp_dcp_violated(tp, dcp):
    with raises("tp >= dcp and tp % dcp == 0 (MLA/SFA)",
                f"tensor_parallel_size={tp}", f"decode_context_parallel_size={dcp}"):
        CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp).validate_for(SFA)


# --------------------------------------------------------------------- GQA: tp // kv >= dcp, divisible


@pytest.mark.parametrize("tp,kv,dcp", [
    (8, 4, 2),    # Qwen3-235B style: 2 TP ranks per KV head, DCP 2
    (8, 1, 8),
    (16, 2, 4),
    (8, 2, 4),
    (4, 4, 1),
    (2, 8, 1),    # no DCP: several KV heads per TP rank is plain TP
    (1, 8, 1),
])
def test_gqa_kv_heads_ok(tp, kv, dcp):
    CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp).validate_for(gqa(kv))


@pytest.mark.parametrize("tp,kv,dcp", [
    (8, 4, 4),    # tp // kv = 2 < 4
    (8, 8, 2),    # tp // kv = 1 < 2
    (4, 8, 2),    # tp // kv = 0
    (12, 2, 4),   # tp // kv = 6, 6 % 4 != 0
    (8, 1, 3),    # 8 % 3 != 0
])
def test_gqa_kv_heads_violated(tp, kv, dcp):
    rule = "tp // num_kv_heads >= dcp and (tp // num_kv_heads) % dcp == 0 (GQA)"
    with raises(rule, f"tensor_parallel_size={tp}", f"num_kv_heads={kv}",
                f"tp // kv = {tp // kv}", f"decode_context_parallel_size={dcp}"):
        CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp).validate_for(gqa(kv))


def test_gqa_rule_does_not_apply_to_mla():
    # tp=4, dcp=4 is fine for MLA (one latent KV per rank) but not for GQA with 4 KV heads.
    cfg = CPConfig(tensor_parallel_size=4, decode_context_parallel_size=4)
    cfg.validate_for(MLA)
    with raises("tp // num_kv_heads >= dcp and (tp // num_kv_heads) % dcp == 0 (GQA)", "num_kv_heads=4"):
        cfg.validate_for(gqa(4))


def test_gqa_num_kv_heads_positive():
    with raises("num_kv_heads >= 1", "num_kv_heads=0"):
        CPConfig().validate_for(gqa(0))


# --------------------------------------------------------------------- SFA: dcp == tp


@pytest.mark.parametrize("tp,dcp,pcp", [(8, 8, 1), (4, 4, 1), (8, 1, 1), (1, 1, 1)])
def test_sfa_dcp_equals_tp_ok(tp, dcp, pcp):
    CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
             prefill_context_parallel_size=pcp).validate_for(SFA)


@pytest.mark.parametrize("tp,dcp", [(8, 4), (8, 2), (4, 2)])
def test_sfa_dcp_equals_tp_violated(tp, dcp):
    cfg = CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp)
    cfg.validate_for(MLA)  # fine for dense MLA
    with raises("dcp == tp for SFA DCP with replicated indexer",
                f"tensor_parallel_size={tp}", f"decode_context_parallel_size={dcp}"):
        cfg.validate_for(SFA)


# --------------------------------------------------------------------- enable_dsa_cp needs an indexer


@pytest.mark.parametrize("dcp, pcp", [(2, 1), (1, 2), (2, 2)])
def test_dsa_cp_with_dcp_or_pcp_refused(dcp, pcp):
    with pytest.raises(ConfigError, match="enable_dsa_cp needs decode_context_parallel_size == 1") as e:
        CPConfig(tensor_parallel_size=2, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
                 enable_dsa_cp=True)
    msg = str(e.value)
    assert "DSA-CP with DCP / PCP is not built" in e.value.rule
    assert f"decode_context_parallel_size={dcp}" in msg and f"prefill_context_parallel_size={pcp}" in msg
    assert "Fix: set enable_dsa_cp=False" in msg


def test_dsa_cp_with_indexer_ok():
    CPConfig(tensor_parallel_size=8, enable_dsa_cp=True).validate_for(SFA)
    CPConfig(tensor_parallel_size=4, enable_dsa_cp=True).validate_for(SFA)
    CPConfig(enable_dsa_cp=False).validate_for(MLA)
    CPConfig(enable_dsa_cp=False).validate_for(gqa(1))


@pytest.mark.parametrize("spec,kind", [(MLA, "'mla'"), (gqa(1), "'gqa'")])
def test_dsa_cp_without_indexer_violated(spec, kind):
    with raises("enable_dsa_cp only for models with an indexer", "enable_dsa_cp=True", kind):
        CPConfig(tensor_parallel_size=4, enable_dsa_cp=True).validate_for(spec)


# --------------------------------------------------------------------- attention spec


def test_attention_spec_rules():
    AttentionSpec("gqa", num_heads=32, num_kv_heads=8)
    AttentionSpec("mla", num_heads=16, has_indexer=True)
    with raises("attention kind is gqa|mla|sfa", "kind='mha'"):
        AttentionSpec("mha", num_heads=8)
    with raises("sfa models have an indexer", "has_indexer=False"):
        AttentionSpec("sfa", num_heads=8)


# --------------------------------------------------------------------- world size == tp * pcp


@pytest.mark.parametrize("tp,dcp,pcp", [(1, 1, 1), (4, 2, 1), (8, 8, 2), (2, 1, 4)])
def test_world_size_ok(tp, dcp, pcp):
    cfg = CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp)
    assert cfg.world_size == tp * pcp
    cfg.validate_world_size(tp * pcp)


@pytest.mark.parametrize("tp,dcp,pcp,world", [(4, 2, 1, 8), (4, 2, 1, 2), (8, 8, 2, 8), (2, 2, 2, 8)])
def test_world_size_violated(tp, dcp, pcp, world):
    cfg = CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp)
    with raises("world size == tp * pcp", f"world_size={world}", f"tensor_parallel_size={tp}",
                f"prefill_context_parallel_size={pcp}", f"tp * pcp = {tp * pcp}"):
        cfg.validate_world_size(world)


# --------------------------------------------------------------------- types (issue 10)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "decode_context_parallel_size",
                                  "prefill_context_parallel_size", "block_size", "cp_kv_cache_interleave_size"])
@pytest.mark.parametrize("bad", [True, False, 2.0, "2", None])
def test_sizes_refuse_bools_and_non_integers(name, bad):
    # bool is an int subclass: CPConfig(tensor_parallel_size=True) used to mean tp = 1.
    rule = f"{name} >= 1"
    with raises(rule, f"{name}={bad!r} ({type(bad).__name__})"):
        CPConfig(**{name: bad})


@pytest.mark.parametrize("name", ["enable_dsa_cp", "enable_mla_preprocess"])
@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_flags_are_bools(name, bad):
    with raises(f"{name} is a bool", f"{name}={bad!r}"):
        CPConfig(**{name: bad})


@pytest.mark.parametrize("field,bad", [("num_heads", True), ("num_heads", 0), ("num_kv_heads", 1.0),
                                       ("num_kv_heads", False)])
def test_attention_spec_counts_are_integers(field, bad):
    with raises(f"{field} >= 1", f"{field}={bad!r}"):
        AttentionSpec("gqa", **{"num_heads": 8, "num_kv_heads": 2, field: bad})


def test_validate_for_applies_tp_divisible_by_dcp_without_a_world():
    # tp // kv = 2 passes the per-head rule; only init_parallel refused it before.
    with raises("tp % dcp == 0", "tensor_parallel_size=5", "decode_context_parallel_size=2"):
        CPConfig(tensor_parallel_size=5, decode_context_parallel_size=2).validate_for(gqa(2))


def test_validate_for_needs_whole_kv_heads_per_dcp_group():
    # tp = 10, kv = 4: tp // kv = 2 and dcp divides both, but ranks 8 and 9 would hold no head.
    with raises("tp % num_kv_heads == 0 (GQA with DCP)", "tensor_parallel_size=10", "num_kv_heads=4"):
        CPConfig(tensor_parallel_size=10, decode_context_parallel_size=2).validate_for(gqa(4))
    CPConfig(tensor_parallel_size=10, decode_context_parallel_size=1).validate_for(gqa(4))  # plain TP: the model's call


def test_validate_for_refuses_a_non_spec():
    with raises("validate_for takes an AttentionSpec", "got dict"):
        CPConfig().validate_for({"kind": "gqa"})


# --------------------------------------------------------------------- PCP (docs/pcp.md)


@pytest.mark.parametrize("tp,dcp,pcp,kv", [(1, 1, 2, 1), (2, 2, 2, 1), (2, 1, 2, 2), (8, 2, 2, 4), (8, 8, 2, 1),
                                            (8, 4, 4, 2)])
def test_pcp_combinations_ok(tp, dcp, pcp, kv):
    """(pcp, dcp, tp) the PCP compositions serve: any pcp with a valid DCP layout; the
    cache is sharded over pcp * dcp ranks, in virtual blocks of block_size * pcp * dcp."""
    cfg = CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp,
                   block_size=16)
    cfg.validate_for(gqa(kv))
    cfg.validate_for(MLA)
    cfg.validate_world_size(tp * pcp)
    assert cfg.context_parallel_size == pcp * dcp
    assert cfg.virtual_block_size == 16 * pcp * dcp


@pytest.mark.parametrize("tp,dcp,pcp", [(8, 8, 2), (4, 4, 2), (2, 1, 2)])
def test_pcp_with_sfa_refused(tp, dcp, pcp):
    cfg = CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, prefill_context_parallel_size=pcp)
    with raises("prefill_context_parallel_size == 1 for SFA (PCP covers GQA and MLA)",
                f"prefill_context_parallel_size={pcp}", "set prefill_context_parallel_size=1"):
        cfg.validate_for(SFA)


def test_pcp_keeps_the_dcp_rules():
    # The GQA DCP rule is unchanged by PCP: PCP peers hold the same TP rank (same KV heads).
    with raises("tp // num_kv_heads >= dcp and (tp // num_kv_heads) % dcp == 0 (GQA)", "num_kv_heads=2", "decode_context_parallel_size=2"):
        CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                 prefill_context_parallel_size=2).validate_for(gqa(2))
