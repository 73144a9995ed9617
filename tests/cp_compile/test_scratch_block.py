"""The scratch block of a paged cache (issue 21, ops/core/scratch_block.py).

GE graphs (torchair max-autotune) write the tokens of slot -1 (padding, another DCP
rank's tokens) into each cache's last page instead of block -1, which CANN's
ScatterNdUpdate does not support. These tests hold the layout side of that contract
on CPU: `allocate_kv_cache(..., scratch_block=True)` adds the page and marks it, the
step check refuses a block table naming it, and the torchair max-autotune lowering
refuses a cache without one before torchair starts. (The GE side, scratch writes and
the evaluator's refusal of out-of-range indices, is in tests/ops/test_torchair_ge.py
and test_ge_value_mutations.py.)
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

import cp_compile
from cp_compile.base.errors import ConfigError, MetadataError
from cp_compile.runtime.kv_cache import KVCacheSpec
from cp_compile.compiler.lowering import _refuse_caches_without_scratch, _refuse_fp8_caches
from cp_compile.runtime.metadata_build import BlockAllocator
from cp_compile.runtime.metadata_checks import validate_step
from cp_compile.ops.core.scratch_block import has_scratch_block, usable_blocks

CFG = cp_compile.CPConfig(block_size=4)
SPEC = KVCacheSpec(num_layers=2, kind="gqa", head_dim=8, num_kv_heads_per_rank=1)


def test_scratch_block_is_one_more_marked_page() -> None:
    plain = cp_compile.allocate_kv_cache(CFG, SPEC, 4)
    scratch = cp_compile.allocate_kv_cache(CFG, SPEC, 4, scratch_block=True)
    assert scratch.num_blocks == plain.num_blocks == 4
    for (k, v), (pk, pv) in zip(scratch.layers, plain.layers):
        assert k.shape[0] == v.shape[0] == 5 and pk.shape[0] == pv.shape[0] == 4
        assert has_scratch_block(k) and has_scratch_block(v[1:]) and usable_blocks(k) == 4  # views keep it
        assert not has_scratch_block(pk) and not has_scratch_block(k.clone())  # a copy is a plain cache


def test_step_check_refuses_a_block_table_naming_the_scratch_block() -> None:
    cache = cp_compile.allocate_kv_cache(CFG, SPEC, 4, scratch_block=True)
    meta = cp_compile.build_attention_metadata([(0, 6)], BlockAllocator(4, CFG.virtual_block_size),
                                               num_padding_tokens=2)
    validate_step(meta, cache.layers)  # blocks 0 and 1, padding slots -1: fine
    meta.block_table[0, 1] = 4  # the scratch block (the tensor's 5th page)
    meta.slot_mapping[4:6] = torch.tensor([16, 17])
    with pytest.raises(MetadataError) as err:
        validate_step(meta, cache.layers)
    assert err.value.field == "block_table" and "blocks [0, 4)" in str(err.value) and "scratch" in str(err.value)
    # The same step over a plain cache of 5 pages is valid: the refusal is the scratch block's.
    validate_step(meta, cp_compile.allocate_kv_cache(CFG, SPEC, 5).layers)


def _cache_write_graph() -> fx.GraphModule:
    def write(new, cache, slots):
        torch.ops.cp.cache_write(new, cache, slots)
        return cache

    return fx.symbolic_trace(write)


def test_ge_lowering_refuses_a_cache_without_scratch_block() -> None:
    gm = _cache_write_graph()
    new, slots = torch.randn(3, 1, 8), torch.tensor([0, -1, 5])
    plain = cp_compile.allocate_kv_cache(CFG, SPEC, 4).layers[0][0]
    with pytest.raises(ConfigError) as err:
        _refuse_caches_without_scratch(gm, [new, plain, slots])
    assert "graph input 1" in str(err.value) and "scratch_block=True" in str(err.value)
    scratch = cp_compile.allocate_kv_cache(CFG, SPEC, 4, scratch_block=True).layers[0][0]
    _refuse_caches_without_scratch(gm, [new, scratch, slots])  # accepted


def test_ge_lowering_refuses_an_fp8_cache_and_takes_int8() -> None:
    """GE graph mode reads a quantised cache through FIA's int8 antiquant inputs (decision 70):
    an fp8 cache is refused at compile time, naming the input, the dtype and the fix."""
    def write(new, cache, scales, slots):
        torch.ops.cp.quant_cache_write(new, cache, scales, slots)
        return cache

    gm = fx.symbolic_trace(write)
    new, slots = torch.randn(3, 1, 8), torch.tensor([0, -1, 5])
    for dtype, refused in (("fp8_e4m3", True), ("int8", False)):
        cfg = cp_compile.CPConfig(block_size=4, kv_cache_dtype=dtype)
        k, _, ks, _ = cp_compile.allocate_kv_cache(cfg, SPEC, 4, scratch_block=True).layers[0]
        if refused:
            with pytest.raises(ConfigError) as err:
                _refuse_fp8_caches(gm, [new, k, ks, slots])
            assert "graph input 1" in str(err.value) and "float8_e4m3fn" in str(err.value) and \
                "kv_cache_dtype='int8'" in str(err.value), str(err.value)
        else:
            _refuse_fp8_caches(gm, [new, k, ks, slots])  # accepted
