"""Bad input is refused before any write, with the same verdict on every rank.

One test per failure a new user hit (issue 10). Each failed before this change:
the caches were written before an IndexError, wrong output came back silently, a
float slot mapping was accepted, a DCP step hung on one rank's error, errors came
from deep inside torch, or a failed batch leaked allocator blocks. Every refusal
here is a `MetadataError` (or `ConfigError` / `ValueError` / `CapacityError` for the
config and the allocator) naming the field, the request, the value and the fix,
and every cache compares bit-identical to its clone from before the step.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile import MetadataError
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import example_from_config, hf_qwen3

BLOCK = 8
NUM_BLOCKS = 6


@pytest.fixture(scope="module")
def qwen():
    hf = hf_qwen3(num_kv_heads=2, num_heads=4)
    return hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()}


def _single(qwen):
    model = example_from_config(*qwen)
    cache = cp_compile.allocate_kv_cache(cp_compile.CPConfig(block_size=BLOCK), model.kv_cache_spec(), NUM_BLOCKS)
    return model, cache


def _step(reqs, num_blocks: int = NUM_BLOCKS, padding: int = 0, width: int | None = 4):
    alloc = cp_compile.BlockAllocator(num_blocks, BLOCK)
    return cp_compile.build_attention_metadata(reqs, alloc, num_padding_tokens=padding, max_blocks_per_req=width)


def _clone(layers):
    return [tuple(t.clone() for t in layer) for layer in layers]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def _gqa_inputs(meta, cache, g=None):
    g = g or torch.Generator().manual_seed(0)
    T = meta.num_tokens
    k_cache, v_cache = cache.layers[0]
    H = k_cache.shape[2]
    return (torch.randn(T, 2 * H, 16, generator=g), torch.randn(T, H, 16, generator=g),
            torch.randn(T, H, 16, generator=g), k_cache, v_cache)


def _refused(call, field: str, *fragments: str) -> MetadataError:
    with pytest.raises(MetadataError) as info:
        call()
    msg = str(info.value)
    assert info.value.field == field and msg.startswith(field), msg
    assert "Fix:" in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return info.value


# ---------------------------------------------------------------- caches written before the error


def test_block_id_past_the_cache_is_refused_before_k_or_v_is_written(qwen):
    model, cache = _single(qwen)
    meta = _step([(0, 3), (0, 5)])
    meta.block_table[1, 0] = NUM_BLOCKS  # the block request 1 writes and reads
    q, k, v, kc, vc = _gqa_inputs(meta, cache)
    before = _clone(cache.layers)
    op = lambda: torch.ops.cp.gqa_paged_attention(q, k, v, kc, vc, meta.slot_mapping, meta.block_table,  # noqa: E731
                                                  meta.seq_lens, meta.query_start_loc, 0.25)
    _refused(op, "block_table", "(request 1)", f"block_table[1, 0] = {NUM_BLOCKS}", f"[0, {NUM_BLOCKS})")
    assert _same(cache.layers, before)
    ids = torch.zeros(meta.num_tokens, dtype=torch.long)
    # The model (eager) and the runtime helper refuse it the same way, before layer 0.
    _refused(lambda: model(ids, meta.positions, cache.layers, meta), "block_table", "(request 1)")
    _refused(lambda: cp_compile.validate_step(meta, cache.layers), "block_table", "(request 1)")
    assert _same(cache.layers, before)


def test_slot_past_the_cache_writes_neither_k_nor_v(qwen):
    _, cache = _single(qwen)
    meta = _step([(0, 4)])
    meta.slot_mapping[2] = NUM_BLOCKS * BLOCK + 5
    q, k, v, kc, vc = _gqa_inputs(meta, cache)
    before = _clone(cache.layers)
    _refused(lambda: torch.ops.cp.gqa_paged_attention(q, k, v, kc, vc, meta.slot_mapping, meta.block_table,
                                                      meta.seq_lens, meta.query_start_loc, 0.25),
             "slot_mapping", f"slot_mapping[2] = {NUM_BLOCKS * BLOCK + 5}")
    assert _same(cache.layers, before)
    _refused(lambda: cp_compile.validate_step(meta, cache.layers), "slot_mapping", "(request 0)",
             "maps to slot 2")


# ---------------------------------------------------------------- silently wrong


def test_seq_lens_below_the_new_tokens_is_refused(qwen):
    model, cache = _single(qwen)
    meta = _step([(2, 1), (0, 6)])
    meta.seq_lens[1] = 4  # 6 new tokens but seq_lens 4: ran and returned wrong logits
    before = _clone(cache.layers)
    ids = torch.zeros(meta.num_tokens, dtype=torch.long)
    _refused(lambda: model(ids, meta.positions, cache.layers, meta), "seq_lens", "(request 1)",
             "seq_lens = 4", "6 new tokens")
    assert _same(cache.layers, before)


@pytest.mark.parametrize("qsl,fragment", [
    ([0, 5, 3], "query_start_loc[1] = 5 > query_start_loc[2] = 3"),  # non-monotone
    ([0, 3, 9], "ends at 9 but the step has only T = 7 tokens"),       # too long
    ([1, 3, 7], "query_start_loc[0] = 1, must be 0"),
])
def test_bad_query_start_loc_is_refused(qwen, qsl, fragment):
    model, cache = _single(qwen)
    meta = _step([(0, 3), (0, 4)])
    meta.query_start_loc = torch.tensor(qsl, dtype=torch.int32)
    before = _clone(cache.layers)
    ids = torch.zeros(meta.num_tokens, dtype=torch.long)
    _refused(lambda: model(ids, meta.positions, cache.layers, meta), "query_start_loc", fragment)
    assert _same(cache.layers, before)


def test_float_slot_mapping_is_refused(qwen):
    # float32 holds integers exactly only up to 2**24: slot 2**24 + 1 would be written at 2**24.
    assert int(torch.tensor([2**24 + 1]).float().long()) == 2**24
    _, cache = _single(qwen)
    meta = _step([(0, 3)])
    meta.slot_mapping = meta.slot_mapping.float()
    _refused(lambda: cp_compile.validate_step(meta, cache.layers), "slot_mapping", "dtype torch.float32", "int64")
    q, k, v, kc, vc = _gqa_inputs(meta, cache)
    _refused(lambda: torch.ops.cp.gqa_paged_attention(q, k, v, kc, vc, meta.slot_mapping, meta.block_table,
                                                      meta.seq_lens, meta.query_start_loc, 0.25),
             "slot_mapping", "dtype torch.float32")
    assert not any(t.any() for layer in cache.layers for t in layer)


def test_padding_token_with_a_real_slot_is_refused(qwen):
    _, cache = _single(qwen)
    meta = _step([(0, 2)], padding=2)
    meta.slot_mapping[3] = 7  # a padding token would overwrite a cached token
    _refused(lambda: cp_compile.validate_step(meta, cache.layers), "slot_mapping", "padding token 3",
             "slot -1")


# ---------------------------------------------------------------- unclear errors


def test_seq_lens_wider_than_the_block_table_names_the_table(qwen):
    model, cache = _single(qwen)
    meta = _step([(0, 3)], width=1)
    meta.seq_lens[0] = 3 + 2 * BLOCK  # was: RuntimeError: shape '[...]' is invalid for input of size ...
    meta.query_start_loc[1] = 3
    ids = torch.zeros(meta.num_tokens, dtype=torch.long)
    _refused(lambda: model(ids, meta.positions, cache.layers, meta), "block_table", "(request 0)",
             "has 1 columns", "needs 3 blocks")
    q, k, v, kc, vc = _gqa_inputs(meta, cache)
    _refused(lambda: torch.ops.cp.gqa_paged_attention(q, k, v, kc, vc, meta.slot_mapping, meta.block_table,
                                                      meta.seq_lens, meta.query_start_loc, 0.25),
             "block_table", "has 1 columns")


def test_empty_batch_is_a_clear_error(qwen):
    alloc = cp_compile.BlockAllocator(4, BLOCK)
    with pytest.raises(ValueError, match="empty batch: requests is empty. Fix: skip the step"):
        cp_compile.build_attention_metadata([], alloc)  # was: max() arg is an empty sequence
    _, cache = _single(qwen)
    empty = cp_compile.AttentionMetadata(torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                                         torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int64),
                                         torch.zeros(0, dtype=torch.int64))
    _refused(lambda: cp_compile.validate_step(empty, cache.layers), "query_start_loc", "the batch is empty")


def test_compiled_entry_validates_before_tracing(qwen):
    model, cache = _single(qwen)
    compiled = cp_compile.compile_model(model, lowering="eager")
    meta = _step([(0, 3)])
    meta.seq_lens[0] = 1
    before = _clone(cache.layers)
    ids = torch.zeros(meta.num_tokens, dtype=torch.long)
    _refused(lambda: compiled(ids, meta.positions, cache.layers, meta), "seq_lens", "(request 0)")
    assert _same(cache.layers, before) and compiled.backend.pass_managers == []  # refused before any trace
    with pytest.raises(MetadataError, match="slot_mapping: has 3 tokens but the step has 2"):
        compiled(ids[:2], meta.positions, cache.layers, _step([(0, 3)]))


# ---------------------------------------------------------------- leaks


def _state(alloc: cp_compile.BlockAllocator):
    return list(alloc._free), {r: list(t) for r, t in alloc._tables.items()}


def test_failed_batch_leaves_the_allocator_exactly_as_it_was():
    alloc = cp_compile.BlockAllocator(num_blocks=5, block_tokens=4)
    cp_compile.build_attention_metadata([(0, 5)], alloc, req_ids=[9])
    before = _state(alloc)
    # Out of blocks on the third request: the first two used to keep theirs.
    with pytest.raises(cp_compile.CapacityError, match="the batch needs 4 more blocks of 4 tokens but only 3"):
        cp_compile.build_attention_metadata([(5, 1), (0, 4), (0, 9)], alloc, req_ids=[9, 1, 2])
    assert _state(alloc) == before
    # Too wide for the block table on the second request: same.
    with pytest.raises(cp_compile.CapacityError, match=r"request 1 \(id 2\) needs 3 blocks .* max_blocks_per_req=2"):
        cp_compile.build_attention_metadata([(0, 4), (0, 9)], alloc, req_ids=[1, 2], max_blocks_per_req=2)
    assert _state(alloc) == before
    for bad, match in [([(0, 1), (-1, 1)], "request 1 .* context_len=-1"), ([(0, 1), (0, 1)], "appears twice")]:
        with pytest.raises(ValueError, match=match):
            cp_compile.build_attention_metadata(bad, alloc, req_ids=[1, 1] if "twice" in match else [1, 2])
        assert _state(alloc) == before


def test_allocator_transaction_rolls_back_every_ensure():
    alloc = cp_compile.BlockAllocator(num_blocks=6, block_tokens=2)
    alloc.ensure(0, 3)
    before = _state(alloc)
    with pytest.raises(KeyError):
        with alloc.transaction():
            alloc.ensure(0, 6)
            alloc.ensure(1, 2)
            raise KeyError("caller failed after allocating")
    assert _state(alloc) == before and alloc.blocks(1) == []
    with pytest.raises(cp_compile.CapacityError):
        alloc.ensure(3, 100)
    assert _state(alloc) == before and 3 not in alloc._tables  # no empty table left behind


# ---------------------------------------------------------------- multi-rank: same verdict, no hang


def _dcp_world(rank: int, world: int, hf_config, state_dict, ok_config, ok_state_dict) -> dict:
    from cp_compile.ops.parallel import dcp as D

    out: dict = {}
    cfg = cp_compile.CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4)
    state = cp_compile.init_parallel(cfg, device="cpu", timeout=20)
    # 1. The compiled path skipped the model rule: 2 KV heads at tp = dcp = 2 gives each
    # rank a different head, and the DCP merge mixed them (logits off by ~10).
    model = example_from_config(hf_config, state_dict, 2, state.layout.tp.rank, state.tp_group)
    try:
        cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), 8)
        out["layout"] = None
    except cp_compile.ConfigError as e:
        out["layout"] = str(e)
    # 2. A slot out of range that only rank 0 owns: rank 0 raised, rank 1 wrote its
    # cache and waited in the Q all-gather. Now both refuse before writing.
    spec = cp_compile.KVCacheSpec(num_layers=1, kind="gqa", head_dim=8, num_kv_heads_per_rank=1, kv_head_ids=(0,))
    cache = cp_compile.allocate_kv_cache(cfg, spec, 4)
    alloc = cp_compile.BlockAllocator(4, cfg.virtual_block_size)
    meta = cp_compile.build_attention_metadata([(0, 3)], alloc, num_padding_tokens=1)
    meta.slot_mapping[2] = 4 * cfg.virtual_block_size + 2  # position 2: owned by rank 0 (interleave 1)
    ctx = D.DCPContext(group=state.layout.cp, interleave=1, block_size=4)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(meta.num_tokens, h, 8, generator=g) for h in (2, 1, 1))
    before = _clone(cache.layers)
    kc, vc = cache.layers[0]
    try:
        cp_compile.validate_step(meta, cache.layers)
        D.dcp_gqa_attention(q, k, v, kc, vc, meta.slot_mapping, meta.block_table, meta.seq_lens,
                            meta.query_start_loc, 0.3, ctx)
        out["bad_step"] = None
    except MetadataError as e:
        out["bad_step"] = str(e)
    out["unchanged"] = _same(cache.layers, before)
    # The compiled entry refuses the same step (before tracing, so no compile here).
    ok_model = example_from_config(ok_config, ok_state_dict, 2, state.layout.tp.rank, state.tp_group)
    compiled = cp_compile.compile_model(ok_model, lowering="eager")
    try:
        compiled(torch.zeros(meta.num_tokens, dtype=torch.long), meta.positions, cache.layers, meta)
    except MetadataError as e:
        out["compiled_bad_step"] = str(e)
    out["unchanged_after_compiled"] = _same(cache.layers, before)
    out["compiled_graphs"] = len(compiled.backend.pass_managers)
    # A forward compiled with another backend runs the single-device ops as written:
    # its (dcp = 1) caches are checked at dcp = 1 even on this DCP state.
    from cp_compile.compiler.decorator import validation_cp
    from cp_compile.runtime.metadata_checks import validate_forward_args

    plain_alloc = cp_compile.BlockAllocator(4, 4)  # dcp = 1 blocks of 4 tokens
    plain_alloc.ensure(-1, 4)  # block 0 taken: the request's blocks are 1 and 2
    plain = cp_compile.build_attention_metadata([(5, 1)], plain_alloc)
    # Plain (unsharded) caches of the same shapes: copies carry no shard tag.
    plain_layers = [tuple(t.clone() for t in layer) for layer in cache.layers]
    plain_args = {"input_ids": torch.zeros(1, dtype=torch.long), "kv_caches": plain_layers, "meta": plain}
    validate_forward_args(plain_args, cp=validation_cp("inductor", 2))
    # This rank's DCP shard under the single-device ops is refused (issue 19), before any write.
    try:
        validate_forward_args({**plain_args, "kv_caches": cache.layers}, cp=validation_cp("inductor", 2))
    except cp_compile.ConfigError as e:
        out["sharded_under_plain"] = str(e)
    try:
        validate_forward_args(plain_args, cp=validation_cp(compiled.backend, 2))
    except MetadataError as e:
        out["plain_under_dcp"] = str(e)
    # The group is still in step: a valid step runs on both ranks.
    good = cp_compile.build_attention_metadata([(0, 3)], cp_compile.BlockAllocator(4, cfg.virtual_block_size))
    q, k, v = (torch.randn(3, h, 8, generator=g) for h in (2, 1, 1))
    out["good"] = D.dcp_gqa_attention(q, k, v, kc, vc, good.slot_mapping, good.block_table, good.seq_lens,
                                      good.query_start_loc, 0.3, ctx)
    return out


def test_dcp_ranks_refuse_the_same_step_and_check_their_layout(qwen):
    ok = hf_qwen3(num_kv_heads=1, num_heads=4)
    ok_sd = {k: v.detach().clone() for k, v in ok.state_dict().items()}
    res = run_on_ranks(_dcp_world, 2, *qwen, ok.config, ok_sd, timeout=300)
    for rank, out in enumerate(res):
        assert "single-device attention op never runs over a DCP / PCP-sharded cache" in out.get(
            "sharded_under_plain", ""), (rank, out.get("sharded_under_plain"))
        lay = out["layout"]
        assert lay is not None and "the ranks of a DCP group hold the same KV-cache layout" in lay, (rank, lay)
        assert "kv_head_ids: DCP rank 0 (global 0) has (0,), DCP rank 1 (global 1) has (1,)" in lay, lay
        assert "Fix: DCP ranks must share KV heads" in lay
        assert out["bad_step"] is not None and out["bad_step"].startswith("slot_mapping (request 0): slot_mapping[2]")
        assert out["compiled_bad_step"] == out["bad_step"], out
        assert out["compiled_graphs"] == 0
        assert out["plain_under_dcp"].startswith("slot_mapping (request 0): slot_mapping[0] = 9 but the token at "
                                                 "position 5 maps to slot 13"), out["plain_under_dcp"]
        assert out["unchanged"] and out["unchanged_after_compiled"], rank
        assert out["good"].shape == (3, 2, 8) and torch.isfinite(out["good"]).all()
