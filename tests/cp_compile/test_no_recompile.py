"""No recompiles across batch sizes, 1 included, on every compiled entry (issue 19).

`compile_model` and `cp_module` (one device, and tp = dcp = 2 on gloo ranks): after
steps of 2 requests, a 1-request decode, a 1-request 3-token prefill, 3 requests and a
1-token batch run in the same graph (`torch.compiler.set_stance("fail_on_recompile")`
after the first step). Before the fix each 1-request step compiled a new graph
(`maybe_mark_dynamic` specialised size 1). The HF Engine runs through the same
mechanism (`decorator.no_size_specialisation`; tests/hf/test_hf_engine.py).
"""

from __future__ import annotations

import torch

import cp_compile
from cp_compile.testing.multirank import run_on_ranks
from examples.models.qwen3 import Qwen3Model
from examples.models.tiny import VOCAB, example_from_config, hf_qwen3

BLOCK = 4
# (request id, context_len, new tokens) per step
SCHEDULE = [
    [(0, 0, 3), (1, 0, 2)],  # 2-request prefill (compiles)
    [(0, 3, 1), (1, 2, 1)],  # 2-request decode
    [(0, 4, 1)],  # 1-request decode (T = B = 1)
    [(2, 0, 3)],  # 1-request 3-token prefill
    [(0, 5, 1), (2, 3, 1), (3, 0, 4)],  # 3 requests, mixed
    [(3, 4, 1)],
]


def _run(compiled, cfg: cp_compile.CPConfig, layers) -> int:
    alloc = cp_compile.BlockAllocator(12, cfg.virtual_block_size)
    g = torch.Generator().manual_seed(0)
    for i, step in enumerate(SCHEDULE):
        meta = cp_compile.build_attention_metadata([(c, n) for _, c, n in step], alloc,
                                                   req_ids=[r for r, _, _ in step], max_blocks_per_req=4)
        ids = torch.randint(0, VOCAB, (meta.num_tokens,), generator=g)
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            compiled(ids, meta.positions, layers, meta)
    return i + 1


def _entries(tp: int, rank: int, group, hf) -> dict:
    sd = hf.state_dict()
    model = example_from_config(hf.config, sd, tp, rank, group)
    Decorated = cp_compile.cp_module(lowering="eager")(type("DecoratedQwen3", (Qwen3Model,), {}))
    decorated = Decorated(model.cfg, tp, rank, group)
    decorated.load_hf_state_dict(sd)
    return {"compile_model": (cp_compile.compile_model(model, lowering="eager"), model),
            "cp_module": (decorated, decorated)}


def _world(rank: int, world: int) -> dict[str, int]:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=world, block_size=BLOCK)
    state = cp_compile.init_parallel(cfg, device="cpu")
    hf = hf_qwen3(num_kv_heads=1)
    graphs = {}
    for name, (compiled, model) in _entries(world, state.layout.tp.rank, state.tp_group, hf).items():
        torch._dynamo.reset()
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), 12, attention=model.attention_spec())
        _run(compiled, cfg, cache.layers)
        backend = compiled.backend if name == "compile_model" else model.cp_compiled.backend
        graphs[name] = len(backend.pass_managers)
    cp_compile.destroy_parallel()
    return graphs


def test_one_device_entries_never_recompile_on_batch_size():
    hf = hf_qwen3(num_kv_heads=1)
    cfg = cp_compile.CPConfig(block_size=BLOCK)
    for name, (compiled, model) in _entries(1, 0, None, hf).items():
        torch._dynamo.reset()
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), 12)
        _run(compiled, cfg, cache.layers)
        backend = compiled.backend if name == "compile_model" else model.cp_compiled.backend
        assert len(backend.pass_managers) == 1, name


def test_dcp2_entries_never_recompile_on_batch_size():
    for graphs in run_on_ranks(_world, 2, timeout=600):
        assert graphs == {"compile_model": 1, "cp_module": 1}, graphs
