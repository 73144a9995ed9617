"""Runtime helpers: block allocator, global metadata builder, KV-cache allocation."""

import pytest
import torch

import cp_compile
from cp_compile.runtime.metadata_checks import validate_metadata
from cp_compile.ops.core import layout


def test_metadata_for_mixed_batch_with_padding():
    alloc = cp_compile.BlockAllocator(num_blocks=6, block_tokens=8)
    cp_compile.build_attention_metadata([(0, 10)], alloc, req_ids=[7])
    meta = cp_compile.build_attention_metadata([(10, 1), (0, 3)], alloc, req_ids=[7, 2], num_padding_tokens=2,
                                               max_blocks_per_req=3)
    assert meta.query_start_loc.tolist() == [0, 1, 4] and meta.seq_lens.tolist() == [11, 3]
    assert meta.block_table.shape == (2, 3) and meta.block_table.dtype == torch.int32
    assert alloc.blocks(7) == [0, 1] and alloc.blocks(2) == [2]
    assert meta.slot_mapping.tolist() == [1 * 8 + 2, 16, 17, 18, -1, -1]
    assert meta.positions.tolist() == [10, 0, 1, 2, 0, 0]
    pos, req = layout.token_positions(meta.query_start_loc, meta.seq_lens, meta.num_tokens)
    assert pos.tolist()[:4] == meta.positions.tolist()[:4] and req.tolist() == [0, 1, 1, 1, -1, -1]


def test_allocator_out_of_capacity_is_loud_and_free_recycles():
    alloc = cp_compile.BlockAllocator(num_blocks=2, block_tokens=4)
    alloc.ensure(0, 8)
    with pytest.raises(cp_compile.CapacityError, match="needs 1 more blocks .* only 0 of 2 are free"):
        cp_compile.build_attention_metadata([(0, 1)], alloc, req_ids=[1])
    assert alloc.blocks(0) == [0, 1]  # nothing live was handed out twice
    alloc.free(0)
    assert alloc.num_free == 2 and alloc.ensure(1, 3) == [0]


def test_block_table_width_overflow_and_bad_requests():
    alloc = cp_compile.BlockAllocator(num_blocks=8, block_tokens=4)
    with pytest.raises(cp_compile.CapacityError, match="max_blocks_per_req=2"):
        cp_compile.build_attention_metadata([(0, 9)], alloc, max_blocks_per_req=2)
    with pytest.raises(ValueError, match="new_tokens=0"):
        cp_compile.build_attention_metadata([(3, 0)], alloc)


def test_allocate_validates_against_the_model():
    cfg = cp_compile.CPConfig(tensor_parallel_size=4, decode_context_parallel_size=4)
    spec = cp_compile.KVCacheSpec(num_layers=1, kind="gqa", head_dim=8, num_kv_heads_per_rank=1)
    with pytest.raises(cp_compile.ConfigError, match="tp // num_kv_heads >= dcp"):
        cp_compile.allocate_kv_cache(cfg, spec, 4, attention=cp_compile.AttentionSpec("gqa", 8, num_kv_heads=2))
    cache = cp_compile.allocate_kv_cache(cfg, spec, 4, attention=cp_compile.AttentionSpec("gqa", 8, 1))
    assert cache.layers[0][0].shape == (4, 128, 1, 8) and cache.tokens_per_rank == 512


def test_validate_uses_the_virtual_block_of_the_dcp_group():
    # Global metadata over virtual blocks of block_size * dcp tokens: valid for a rank's
    # cache of 4-token pages at dcp = 2, wrong for the same cache at dcp = 1.
    alloc = cp_compile.BlockAllocator(num_blocks=4, block_tokens=8)
    meta = cp_compile.build_attention_metadata([(9, 2), (0, 3)], alloc, num_padding_tokens=1)
    validate_metadata(meta, num_blocks=4, block_size=4, cp=2, num_tokens=6)
    with pytest.raises(cp_compile.MetadataError, match=r"^block_table \(request 0\): has 2 columns but "
                                                      r"seq_lens = 11 needs 3 blocks of 4 tokens"):
        validate_metadata(meta, num_blocks=4, block_size=4, cp=1)
    with pytest.raises(cp_compile.MetadataError, match=r"outside the cache's blocks \[0, 1\)"):
        validate_metadata(meta, num_blocks=1, block_size=4, cp=2)


def test_validate_step_reads_the_cache_geometry():
    cfg = cp_compile.CPConfig(block_size=8)
    spec = cp_compile.KVCacheSpec(num_layers=2, kind="mla", latent_dim=4)
    cache = cp_compile.allocate_kv_cache(cfg, spec, 3)
    alloc = cp_compile.BlockAllocator(num_blocks=3, block_tokens=8)
    meta = cp_compile.build_attention_metadata([(0, 20)], alloc)
    cp_compile.validate_step(meta, cache.layers)
    with pytest.raises(cp_compile.MetadataError, match=r"kv_caches: cache tensors disagree: 2 blocks on cpu, 3 blocks on cpu; pages of \[8\] tokens"):
        cp_compile.validate_step(meta, [cache.layers[0], (torch.zeros(2, 8, 4),)])
    with pytest.raises(cp_compile.MetadataError, match="metadata: is on meta but the KV cache is on cpu"):
        cp_compile.validate_step(meta.to("meta"), cache.layers)
