"""The full-weight o_proj composition (ops/parallel/o_proj.py) on gloo ranks, tp = 2.

For one o_proj layer built from a full float weight, unquantised and W8A8
(dynamic, static with a different calibrated scale / offset per input shard):
`o_proj_full_weight` on each rank's TP inputs == the row-parallel TP o_proj
(partial linear + all-reduce), for T even, odd and below tp. Exactness:
- W8A8: bitwise (torch.equal). Activations are quantised per former shard
  (groups = tp), so the int32 accumulators are the TP ranks'; the dequantised fp32
  partials are summed once (2 terms at tp = 2: a + b == b + a in IEEE).
- unquantised fp32: 1e-5 (one matmul over `in` vs two partial matmuls summed).
Bytes sent per layer (CollectiveMeter) equal `o_proj_bytes_per_step`.
"""

from __future__ import annotations

import torch

import cp_compile
from cp_compile.base.comm_stats import CollectiveMeter
from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel.o_proj import INPUT_SHARDED, o_proj_bytes_per_step, o_proj_full_weight
from cp_compile.testing.multirank import run_on_ranks
from examples.models.common import RowParallelLinear
from examples.models.quant import W8A8Config, W8A8RowParallelLinear

IN, OUT = 48, 40
QUANTS = {"linear": None, "w8a8_dynamic": W8A8Config("dynamic"),
          "w8a8_static": W8A8Config("static", input_scales=(0.02, 0.035), input_offsets=(3, -2))}


def build(kind: str, tp: int, rank: int, group, W: torch.Tensor):
    q = QUANTS[kind]
    m = RowParallelLinear(IN, OUT, tp, rank, tp_group=group) if q is None else \
        W8A8RowParallelLinear(IN, OUT, tp, rank, tp_group=group, quant=q)
    m.load_full(W)
    return m


def params_of(m) -> dict[str, torch.Tensor]:
    return {n: p for n, p in m.named_parameters() if n != "bias"}


def _rank(rank: int, world: int, token_counts: list[int]) -> dict:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, enable_dsa_cp=True, block_size=4)
    state = cp_compile.init_parallel(cfg, device="cpu")
    ctx = CompileContext.from_state(state).tp_view()
    g = torch.Generator().manual_seed(0)
    W = torch.randn(OUT, IN, generator=g) / IN ** 0.5
    k = IN // world
    out: dict = {}
    for kind in QUANTS:
        m = build(kind, world, rank, state.tp_group, W)
        for T in token_counts:
            x_full = torch.randn(T, IN, generator=g)  # same on every rank (same seed sequence)
            x = x_full[:, rank * k:(rank + 1) * k].contiguous()  # [T, in/tp]: this rank's features
            with torch.no_grad():
                with CollectiveMeter() as tp_meter:
                    want = m(x)  # row-parallel: partial linear + all-reduce
                with CollectiveMeter() as meter:
                    got = o_proj_full_weight(kind, x, params_of(m), ctx, groups=getattr(m, "local_groups", 1))
            sharded = sum(params_of(m)[n].numel() * params_of(m)[n].element_size() for n, _ in INPUT_SHARDED[kind])
            out[(kind, T)] = dict(equal=torch.equal(got, want), diff=(got - want).abs().max().item(),
                                  shape=tuple(got.shape), sent=dict(meter.sent), tp_sent=dict(tp_meter.sent), calls=dict(meter.calls),
                                  sharded_bytes=sharded)
    return out


def test_full_weight_o_proj_equals_row_parallel_on_ranks():
    tp, counts = 2, [8, 7, 1, 1023]
    per_rank = run_on_ranks(_rank, tp, counts, timeout=300)
    for rank, res in enumerate(per_rank):
        for (kind, T), r in res.items():
            assert r["shape"] == (T, OUT)
            if kind == "linear":
                assert r["diff"] < 1e-5, (rank, kind, T, r["diff"])
            else:
                assert r["equal"], (rank, kind, T, r["diff"])  # bitwise
            f = o_proj_bytes_per_step(T, IN, OUT, tp, 4, r["sharded_bytes"])
            assert r["tp_sent"] == {"all_reduce": f["all_reduce"]}
            assert r["sent"]["all_to_all"] == f["token_all_to_all"]
            assert r["sent"]["all_gather"] == f["weight_gather"] + f["output_all_gather"]
            # One all-to-all, one gather per input-sharded parameter, one output gather; no all-reduce.
            assert r["calls"] == {"all_to_all": 1, "all_gather": len(INPUT_SHARDED[kind]) + 1}, r["calls"]
    print(f"\no_proj bytes sent per rank and layer, tp {tp}, in {IN}, out {OUT}, fp32 activations, T = 1023 "
          f"(CollectiveMeter == formula):")
    for kind in QUANTS:
        r = per_rank[0][(kind, 1023)]
        print(f"  {kind:13s} row-parallel all-reduce {r['tp_sent']['all_reduce']:>8,d} | full weight: parameter "
              f"gathers + output gather {r['sent']['all_gather']:>8,d}, token all-to-all {r['sent']['all_to_all']:>7,d}")


def test_eager_switch_refuses_a_model_without_tp_o_projs():
    """OProjFullWeight on a single-device model: a ConfigError naming the o_proj and the fix,
    before any parameter is touched."""
    import pytest

    from cp_compile.base.config import ConfigError
    from cp_compile.runtime.o_proj_full_weight import OProjFullWeight
    from examples.models.tiny import example_from_hf, hf_deepseek_sfa

    model = example_from_hf(hf_deepseek_sfa("deepseek_v32", num_heads=4))
    ptrs = [p.data_ptr() for p in model.parameters()]
    with pytest.raises(ConfigError, match=r"'self_attn.o_proj': tp_size=1.*tensor_parallel_size > 1"):
        OProjFullWeight(model)
    with pytest.raises(ValueError, match="names no submodule"):
        OProjFullWeight(model, o_proj="self_attn.out_proj")
    assert ptrs == [p.data_ptr() for p in model.parameters()]
