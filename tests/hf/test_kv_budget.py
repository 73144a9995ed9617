"""The KV pool sized from a per-rank memory budget (cp_compile/serving/hf/kv_budget.py).

At tp 2 on gloo ranks, the same `kv_cache_memory_bytes` per rank, dcp 1 then dcp 2,
built through `build_engine` (the LLM / server path): dcp 2 reports 2x the tokens per
DCP group and 2x the maximum concurrency at max_model_len, and the engine really runs
2x the requests of max_model_len at once (continuous batching; the rest queue and
all finish). A budget too small for one request is refused before any rank starts.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
from cp_compile.runtime.parallel_state import destroy_parallel
from cp_compile.serving.entrypoints.executors import EngineArgs, build_engine
from cp_compile.testing.multirank import run_on_ranks
from examples.models.tiny import hf_qwen3

MAX_LEN = 32
BLOCK = 4
# tiny Qwen3, 2 layers, 1 KV head of 16, fp32: a block is 2 layers x (K, V) x 4 tokens x 16 x 4 B
# = 1024 B on every rank (the one KV head is replicated over the TP ranks).
BLOCK_BYTES = 1024
BUDGET = 3 * (MAX_LEN // BLOCK) * BLOCK_BYTES  # three requests of max_model_len at dcp 1
N_REQUESTS = 8


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("kvb") / "qwen3")
    model = hf_qwen3(num_kv_heads=1)
    model.generation_config.eos_token_id = None
    model.save_pretrained(path)
    return path


def _args(path: str, dcp: int, **kw) -> EngineArgs:
    base = dict(model=path, tensor_parallel_size=2, decode_context_parallel_size=dcp, block_size=BLOCK,
                max_model_len=MAX_LEN, max_num_seqs=16, kv_cache_memory_bytes=BUDGET, lowering="eager")
    return EngineArgs(**{**base, **kw})


def _world(rank: int, world: int, path: str) -> dict:
    out = {}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (MAX_LEN - 8,), generator=g).tolist() for _ in range(N_REQUESTS)]
    for dcp in (1, 2):
        engine = build_engine(_args(path, dcp))
        tokens = engine.generate(prompts, max_new_tokens=8)  # each request: max_model_len tokens
        out[dcp] = dict(pool=engine.kv_pool, capacity=engine.capacity(), peak=engine.peak_batch,
                        lengths=[len(t) for t in tokens], tokens=tokens)
        destroy_parallel()
    return out


def test_dcp2_serves_twice_the_tokens_and_requests_from_the_same_bytes(ckpt, capfd):
    outs = run_on_ranks(_world, 2, ckpt, timeout=600)
    printed = capfd.readouterr().out
    for rank, out in enumerate(outs):
        one, two = out[1], out[2]
        assert one["pool"].block_bytes == two["pool"].block_bytes == BLOCK_BYTES
        assert one["pool"].num_blocks == two["pool"].num_blocks == BUDGET // BLOCK_BYTES
        assert one["capacity"]["kv_bytes_per_rank"] == two["capacity"]["kv_bytes_per_rank"] == BUDGET
        assert two["pool"].tokens_per_group == 2 * one["pool"].tokens_per_group
        assert (one["pool"].max_concurrency, two["pool"].max_concurrency) == (3, 6)
        # Admitted at once, measured in the engine's steps; the others queued and finished.
        assert (one["peak"], two["peak"]) == (3, 6), (rank, one["peak"], two["peak"])
        assert one["lengths"] == two["lengths"] == [8] * N_REQUESTS
        assert one["tokens"] == two["tokens"]  # dcp changes where KV lives, not the tokens
    # The start-up report, printed once per engine (rank 0).
    for dcp, pool in ((1, outs[0][1]["pool"]), (2, outs[0][2]["pool"])):
        assert printed.count("\n".join(pool.lines())) == 1, (dcp, printed)
    assert f"{BUDGET // BLOCK_BYTES * BLOCK:,d} tokens per rank, {BUDGET // BLOCK_BYTES * BLOCK * 2:,d} tokens per " \
           "DCP group" in printed
    assert f"Maximum concurrency for {MAX_LEN} tokens per request: 6 " in printed


@pytest.mark.parametrize("kw,match", [
    (dict(kv_cache_memory_bytes=BLOCK_BYTES * 7), r"kv_cache_memory_bytes=7,168: 7 blocks .* needs 8\. Fix: "
                                                  r"kv_cache_memory_bytes >= 8,192"),
    (dict(kv_cache_memory_bytes=0), r"kv_cache_memory_bytes=0\. Fix"),
    (dict(kv_cache_memory_bytes=True), r"kv_cache_memory_bytes=True\. Fix"),
    (dict(num_kv_blocks=64), r"num_kv_blocks=64, kv_cache_memory_bytes=24576\. Fix"),
])
def test_bad_budget_refused_before_ranks_start(ckpt, kw, match):
    with pytest.raises(cp_compile.ConfigError, match=match):
        _args(ckpt, 1, **kw).validate()


# The all-reduce fold at tp 2 / dcp 2 on this checkpoint: the other DCP rank's o_proj columns,
# [hidden 64, 2 heads x 16] fp32, per layer, 2 layers (decision 73).
FOLD_BYTES = 2 * 64 * 2 * 16 * 4


def test_the_gathered_weights_are_taken_out_of_the_budget(ckpt):
    """Under dcp_merge_fold="on" the pool holds (budget - the fold's gathered bytes) // block
    bytes blocks; under "auto" the same where those bytes are within FOLD_KV_FRACTION of the
    budget and nothing where above (the pass's own rule never folds then); "off" nothing. The
    start-up lines name the bytes; a budget the reserve leaves too small is refused naming both."""
    import transformers

    from cp_compile.base.merge_cost import FOLD_KV_FRACTION
    from cp_compile.serving.hf.gathered_weights import gathered_weight_bytes
    from cp_compile.serving.hf.kv_budget import plan_pool

    hf_config = transformers.AutoConfig.from_pretrained(ckpt)
    for fold, budget, reserved in (("on", BUDGET, FOLD_BYTES), ("off", BUDGET, 0),
                                   ("auto", BUDGET, 0),  # 16 KiB is 0.67 of 24 KiB: above 5 %
                                   ("auto", int(FOLD_BYTES / FOLD_KV_FRACTION), FOLD_BYTES)):
        cfg = _args(ckpt, 2, dcp_merge_fold=fold, kv_cache_memory_bytes=budget).cp_config()
        got = gathered_weight_bytes(cfg, hf_config, torch.float32, budget)
        assert got == reserved, (fold, budget, got)
        pool = plan_pool(cfg, BLOCK_BYTES, MAX_LEN, 16, budget, reserved_bytes=got)
        assert pool.num_blocks == (budget - reserved) // BLOCK_BYTES
        assert pool.tokens_per_rank == (budget - reserved) // BLOCK_BYTES * BLOCK
        assert f"Gathered weights (all-reduce fold / project before the merge): {reserved:,d} B" in pool.lines()[-1]
    with pytest.raises(cp_compile.ConfigError, match=r"less 16,384 B of gathered weights: 3 blocks .* needs 4\. "
                                                     r"Fix: kv_cache_memory_bytes >= 20,480"):
        _args(ckpt, 2, dcp_merge_fold="on", kv_cache_memory_bytes=FOLD_BYTES + 3 * BLOCK_BYTES).validate()


def _fold_world(rank: int, world: int, path: str) -> dict:
    engine = build_engine(_args(path, 2, dcp_merge_fold="on", lowering="aot_eager"))
    engine.generate([[5, 6, 7, 8, 9]], max_new_tokens=2)  # compiles: the fold gathers its weights here
    out = dict(pool=engine.kv_pool, capacity=engine.capacity())
    destroy_parallel()
    return out


@pytest.mark.slow
def test_fold_pool_holds_the_budget_less_what_the_pass_gathered(ckpt):
    """Through build_engine at tp 2 / dcp 2, dcp_merge_fold="on": the pool holds exactly
    (budget - reserved) // block bytes blocks, and the reserve equals the bytes the fold pass
    gathered at the first compile (Engine.capacity)."""
    for rank, out in enumerate(run_on_ranks(_fold_world, 2, ckpt, timeout=600)):
        pool, cap = out["pool"], out["capacity"]
        assert pool.gathered_weight_bytes == FOLD_BYTES == cap["gathered_weight_bytes_per_rank"], (rank, cap)
        assert pool.num_blocks == (BUDGET - FOLD_BYTES) // BLOCK_BYTES
        assert cap["kv_bytes_per_rank"] + cap["gathered_weight_bytes_per_rank"] <= BUDGET
        assert cap["tokens_per_rank"] == (BUDGET - FOLD_BYTES) // BLOCK_BYTES * BLOCK
