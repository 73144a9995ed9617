"""`examples/serving.run_schedule` over the one step loop (`StepLoop` with a
`ForwardExecutor`), single device, eager: the schedule's joins and leaves decide who
runs each step, and each step's logits equal an independent prefill of the request's
whole sequence into a fresh cache (so the cached context and the batch composition
are right); a schedule the blocks cannot serve is refused
at the step a request cannot join, naming it.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from examples.models.tiny import VOCAB, example_from_config, hf_qwen3
from examples.serving import layer_caches, run_schedule, tiny_schedule

BLOCK, NUM_BLOCKS, STEPS = 4, 12, 8


@pytest.fixture(scope="module")
def model():
    hf = hf_qwen3(num_kv_heads=1, num_heads=4)
    return example_from_config(hf.config, {k: v.detach().clone() for k, v in hf.state_dict().items()})


def _fresh_prefill(model, tokens: list[int]) -> torch.Tensor:
    """The last-token logits [V] of `tokens` prefilled at once into an empty cache."""
    cache = cp_compile.allocate_kv_cache(cp_compile.CPConfig(block_size=BLOCK), model.kv_cache_spec(), NUM_BLOCKS)
    meta = build_attention_metadata([(0, len(tokens))], BlockAllocator(NUM_BLOCKS, BLOCK), max_blocks_per_req=8)
    with torch.no_grad():
        return model(torch.tensor(tokens), meta.positions, layer_caches(cache), meta)[-1]


def test_run_schedule_follows_joins_and_leaves_and_equals_a_fresh_prefill(model):
    cfg = cp_compile.CPConfig(block_size=BLOCK)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS)
    schedule = tiny_schedule(VOCAB, num_steps=STEPS)  # 0, 1 join at step 0; 2 at step 3; 1 leaves before step 7
    metas = []
    res = run_schedule(model, layer_caches(cache), cfg, NUM_BLOCKS, schedule, on_step=lambda s, m: metas.append(m))
    assert [r.req_ids for r in res] == [[0, 1]] * 3 + [[0, 1, 2]] * 4 + [[0, 2]]
    assert [m.query_start_loc.tolist() for m in metas[2:4]] == [[0, 1, 2], [0, 1, 2, 7]]  # 2's prompt beside decodes
    seqs = {r: list(p) for r, p in schedule.prompts.items()}
    for step, r in enumerate(res):
        for i, rid in enumerate(r.req_ids):
            torch.testing.assert_close(r.last_logits[i], _fresh_prefill(model, seqs[rid]), atol=1e-4, rtol=1e-4,
                                       msg=f"step {step} request {rid}")
            assert r.next_tokens[i] == int(r.last_logits[i].argmax())
            seqs[rid].append(r.next_tokens[i])


def test_a_schedule_the_blocks_cannot_serve_is_refused_at_the_join(model):
    """Requests 0, 1, 2 hold 4 + 3 + 3 blocks of 4 tokens (prompt + the steps each runs):
    with 9 blocks request 2 cannot join at step 3."""
    cfg = cp_compile.CPConfig(block_size=BLOCK)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS)
    with pytest.raises(ValueError, match=r"schedule step 3: requests \[2\] cannot join.*Fix: more blocks"):
        run_schedule(model, layer_caches(cache), cfg, 9, tiny_schedule(VOCAB, num_steps=STEPS))
