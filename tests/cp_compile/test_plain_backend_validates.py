"""The README's first usage, plain `torch.compile(model, backend="cp_ascend")`, validates every step (issue 19).

Before: only `compile_model` / `@cp_module` validated metadata; the example models skip
their eager `validate_step` while compiling, so a step whose `seq_lens` is smaller
than its new tokens ran through the plain backend and returned wrong logits, no
error. Now the backend records which graph inputs are the metadata fields and the
caches (the arguments of the cp ops that write a cache) and checks each call on the
host before the graph runs: refused with the field, value and fix, caches unchanged,
the same verdict on every rank (the two-rank dcp 2 case runs in
test_sharded_cache_refusal.py's world, one spawn for both).
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile import MetadataError
from examples.models.tiny import VOCAB, example_from_config, hf_qwen3


def _clone(layers):
    return [tuple(t.clone() for t in layer) for layer in layers]


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for la, lb in zip(a, b) for x, y in zip(la, lb))


def _bad_step(block_tokens: int):
    """A good first step, then one of the same shapes (no recompile) whose request 1
    brings 6 new tokens with seq_lens 4."""
    alloc = cp_compile.BlockAllocator(6, block_tokens)
    good = cp_compile.build_attention_metadata([(0, 2), (0, 6)], alloc, max_blocks_per_req=4)
    bad = cp_compile.build_attention_metadata([(2, 2), (0, 6)], alloc, req_ids=[0, 2], max_blocks_per_req=4)
    bad.seq_lens[1] = 4
    return good, bad


def run_bad_step(compiled, layers, block_tokens: int) -> dict:
    good, bad = _bad_step(block_tokens)
    ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(0))
    out: dict = {}
    with torch.no_grad():
        out["good"] = compiled(ids, good.positions, layers, good)
        before = _clone(layers)
        try:
            out["bad"] = compiled(ids, bad.positions, layers, bad)
        except MetadataError as e:
            out["error"] = str(e)
    out["unchanged"] = _same(layers, before)
    return out


def assert_refused(out: dict) -> None:
    err = out.get("error")
    assert err is not None, "the bad step ran (wrong logits, no error)"
    assert err.startswith("seq_lens (request 1): seq_lens = 4 is smaller than the request's 6 new tokens"), err
    assert "Fix: seq_lens counts context + new tokens" in err, err
    assert out["unchanged"], "a cache was written before the refusal"


def test_plain_cp_ascend_backend_refuses_bad_seq_lens_at_one_device():
    hf = hf_qwen3(num_layers=1)
    model = example_from_config(hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()})
    cache = cp_compile.allocate_kv_cache(cp_compile.CPConfig(block_size=4), model.kv_cache_spec(), 6)
    # The README's line, Inductor lowering (its compiled callable is boxed).
    out = run_bad_step(torch.compile(model, backend="cp_ascend", fullgraph=True), cache.layers, 4)
    with torch.no_grad():  # the good step matches the eager model
        ref_cache = cp_compile.allocate_kv_cache(cp_compile.CPConfig(block_size=4), model.kv_cache_spec(), 6)
        good, _ = _bad_step(4)
        ids = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(0))
        torch.testing.assert_close(out["good"], model(ids, good.positions, ref_cache.layers, good),
                                   atol=1e-4, rtol=1e-4)
    assert_refused(out)


def test_step_check_is_not_duplicated_under_compile_model():
    """compile_model validates at its entry (with input_ids' token count) and turns
    the backend's per-call check off: one host check per step, not two."""
    hf = hf_qwen3(num_layers=1)
    model = example_from_config(hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()})
    compiled = cp_compile.compile_model(model, lowering="eager")
    cache = cp_compile.allocate_kv_cache(cp_compile.CPConfig(block_size=4), model.kv_cache_spec(), 6)
    good, bad = _bad_step(4)
    with torch.no_grad():
        compiled(torch.zeros(8, dtype=torch.long), good.positions, cache.layers, good)
    assert all(not b.validate_steps for b in compiled.backends.values())
    with pytest.raises(MetadataError, match="seq_lens = 4 is smaller"):
        compiled(torch.zeros(8, dtype=torch.long), bad.positions, cache.layers, bad)


def test_cache_write_with_in_graph_metadata_is_not_silently_unchecked():
    """A cache write whose slots are computed inside the graph cannot be checked per
    call: the backend says so at compile time (never silently nothing)."""

    def step(new, cache, slots):
        torch.ops.cp.cache_write(new, cache, slots + 0)
        return cache.sum()

    with pytest.warns(UserWarning, match="cannot check them per step"):
        torch.compile(step, backend=cp_compile.backend(lowering="eager"), fullgraph=True)(
            torch.ones(2, 3), torch.zeros(4, 2, 3), torch.tensor([0, 1]))
