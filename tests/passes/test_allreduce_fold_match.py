"""The all-reduce fold (issue 37, decision 62), in one process: the matcher's proof and
refusals on the single-device graph, the DCP pass's decision under "on" / "auto", and the
cost model's fold candidates. Numerics on real gloo ranks: tests/passes/test_allreduce_fold.py.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import _functional_collectives as funcol

import cp_compile
from cp_compile.base import merge_cost
from cp_compile.base.comm_stats import merge_collectives
from cp_compile.base.parallel_layout import Group
from cp_compile.passes.fold_match import find_fold
from cp_compile.passes.pass_manager import PassManager
from tests.passes.test_pipeline import D, H, LAYERS, _ctx, _inputs
from tests.passes.test_project_before_merge_match import _Stop

HID = 24
cp = torch.ops.cp


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group (the graph's all-reduces name it), torn down after the module."""
    if dist.is_initialized():
        pytest.fail("a default process group is already initialised in the test process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield dist.group.WORLD
    dist.destroy_process_group()


class GQAOut(nn.Module):
    """`LAYERS` GQA layers, each o = attention -> o_proj (row-parallel: F.linear, then a sum
    all-reduce over `group`); `variant` puts something in the chain."""

    def __init__(self, group, variant: str = "ok") -> None:
        super().__init__()
        self.group, self.variant = group, variant
        self.q_proj = nn.ModuleList(nn.Linear(H * D, H * D) for _ in range(LAYERS))
        self.o_w = nn.ParameterList(nn.Parameter(torch.randn(HID, H * D)) for _ in range(LAYERS))
        self.o_b = nn.ParameterList(nn.Parameter(torch.randn(HID)) for _ in range(LAYERS))
        self.back = nn.ModuleList(nn.Linear(HID, H * D) for _ in range(LAYERS))
        # A W8A8 o_proj's operands: int8 weight [in, out], per-output-channel scale / offset; the
        # static scheme's calibrated input scale / offset (one group), quant bias, dequant scale.
        g = torch.Generator().manual_seed(0)
        self.register_buffer("q_w", torch.randint(-127, 128, (H * D, HID), dtype=torch.int8, generator=g))
        self.register_buffer("q_scale", torch.rand(HID, generator=g) / 100)
        self.register_buffer("q_offset", torch.zeros(HID, dtype=torch.int32))
        self.register_buffer("q_in_scale", torch.tensor([0.05]))
        self.register_buffer("q_in_offset", torch.tensor([2], dtype=torch.int32))
        self.register_buffer("q_bias", torch.zeros(1, HID, dtype=torch.int32))
        self.register_buffer("q_deq", torch.rand(1, HID, generator=g) / 100)

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], meta: cp_compile.AttentionMetadata):
        args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc)
        T = x.shape[0]
        for i in range(LAYERS):
            q = self.q_proj[i](x).view(T, H, -1)
            o = cp.gqa_paged_attention(q, q[:, :1], q[:, :1], caches[2 * i], caches[2 * i + 1], *args, 0.5)
            if self.variant == "gelu":
                o = torch.nn.functional.gelu(o)
            w = self.o_w[i] * 2 if self.variant == "computed" else self.o_w[i]
            bias = self.o_b[i] if self.variant == "bias" else None
            if self.variant == "w8a8_dynamic":
                y = cp.w8a8_dynamic_linear(o.reshape(T, H * D), self.q_w, self.q_scale, self.q_offset, 1)
            elif self.variant == "w8a8_static":
                y = cp.w8a8_static_linear(o.reshape(T, H * D), self.q_w, self.q_in_scale, self.q_in_offset,
                                          self.q_bias, self.q_deq)
            else:
                y = torch.nn.functional.linear(o.reshape(T, H * D), w, bias)
            if self.variant == "between":
                y = y * 0.5
            y = funcol.all_reduce(y, "sum", self.group)
            if self.variant == "bias_after":  # RowParallelLinear's bias: after the reduction, foldable
                y = y + self.o_b[i]
            x = self.back[i](y)
        return x


def _gqa_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "gqa_paged_attention" in str(n.target)]


def _ctx_on(group, fold: str, pcp: int = 1):
    if pcp == 1:
        ctx = _ctx("gqa", 2, "ag_rs", tp=2)
    else:  # a decode graph at pcp > 1: the DCP pass over the pcp * dcp cp ranks (docs/pcp.md §5)
        ctx = dataclasses.replace(_ctx("gqa", 1, "ag_rs", tp=2, pcp=pcp), batch_kind="decode")
    layout = dataclasses.replace(ctx.layout, tp=Group(2, 0, group.group_name))
    return dataclasses.replace(ctx, layout=layout, config=dataclasses.replace(ctx.config, dcp_merge_fold=fold))


def _analyse(model: nn.Module, group, pcp: int = 1) -> tuple[list, Exception | None, dict]:
    """In one backend call: the matcher on every attention node, the pipeline under "on" (its
    ConfigError, or None), then under "auto" (the DCP pass's decision)."""
    out = {}

    def backend(gm, example_inputs):
        try:
            found = [find_fold(n, H, group.group_name, False) for n in _gqa_nodes(gm)]
            try:
                PassManager.for_context(_ctx_on(group, "on", pcp))(gm)
                on_error = None
            except cp_compile.ConfigError as e:
                on_error = e
            pm = PassManager.for_context(_ctx_on(group, "auto", pcp))
            pm(gm)
            out["value"] = found, on_error, dict(pm.history[0].decision or {})
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e
        raise _Stop

    torch._dynamo.reset()
    with pytest.raises(Exception):
        torch.compile(model, backend=backend, fullgraph=True, dynamic=True)(*_inputs("gqa"))
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("variant", ["ok", "bias_after"])
def test_the_fold_is_proven_on_a_row_parallel_o_proj(group, variant: str) -> None:
    """Proven on every layer (a bias after the all-reduce is fine); without a process group to
    gather o_proj over the DCP pass does not fold and says why ("on": a ConfigError)."""
    found, on_error, decision = _analyse(GQAOut(group, variant), group)
    assert len(found) == LAYERS
    for fold in found:
        assert not isinstance(fold, str), fold
        assert fold.projection is None and tuple(fold.weight.meta["example_value"].shape) == (HID, H * D)
    assert on_error is not None and "no process group to gather the o_proj columns" in str(on_error)
    assert "fold" not in decision or decision["fold"] is False
    assert "no process group" in decision["not_foldable"]


@pytest.mark.parametrize("variant,reason", [
    ("bias", "adds a bias before the TP all-reduce"),
    ("between", "before any TP all-reduce: nothing may come between o_proj and the all-reduce"),
    ("gelu", "not a reshape to [T, H*Dv] feeding a row-parallel o_proj"),
    ("computed", "is not a parameter with a real value in the graph"),
    # W8A8 o_proj: its input quantisation does not commute with the merge (decision 73).
    ("w8a8_dynamic", "cp::w8a8_dynamic_linear (W8A8): its input is quantised per token"),
    ("w8a8_static", "cp::w8a8_static_linear (W8A8): its input is rounded to int8 at a calibrated scale"),
])
def test_refused_where_not_provable(group, variant: str, reason: str) -> None:
    """Each refusal: the matcher's reason, kept in the DCP pass's decision under "auto" (not
    folded), and a ConfigError naming it and the fix under "on"."""
    found, on_error, decision = _analyse(GQAOut(group, variant), group)
    assert all(isinstance(f, str) and reason in f for f in found), found
    assert reason in decision["not_foldable"] and not decision.get("fold")
    assert on_error is not None and reason in str(on_error) and "dcp_merge_fold='auto'" in str(on_error)


def test_refused_on_pcp_decode_graphs_by_the_layout(group) -> None:
    """A decode graph at pcp = 2 merges over the cp group (the PCP peers: the same TP rank in the
    other TP group), which the TP all-reduce after o_proj does not span: refused by that reason
    (the matcher itself proves the o_proj chain), "on" a ConfigError naming it (decision 73)."""
    found, on_error, decision = _analyse(GQAOut(group), group, pcp=2)
    assert all(not isinstance(f, str) for f in found), found  # the o_proj chain is provable
    reason = "reaches beyond this rank's TP group"
    assert reason in decision["not_foldable"] and not decision.get("fold"), decision
    assert on_error is not None and reason in str(on_error) and "dcp_merge_fold='auto'" in str(on_error)


def test_fold_candidates_drop_the_output_collective_and_pay_the_o_proj() -> None:
    """The fold's collectives are the Q and LSE all-gathers; its prediction adds (N - 1) o_proj
    products; "auto" leaves it out above FOLD_KV_FRACTION of the KV bytes, "on" takes it."""
    T, h, dq, dv, n = 8, 16, 128, 128, 2
    folded = merge_collectives(T, h, dq, dv, 2, n, "ag_rs", fold=True)
    assert folded == merge_collectives(T, h, dq, dv, 2, n, "ag_rs")[:2]  # the reduce-scatter gone
    assert merge_collectives(T, h, dq, dv, 2, n, "replicate", fold=True) == [folded[1]]
    costs = merge_cost.CollectiveCosts({k: 1e-3 for k in merge_cost.KINDS}, {k: 1e-9 for k in merge_cost.KINDS}, n,
                                       "test", matmul_s_per_weight_byte=1e-12, matmul_s_per_flop=1e-14)
    w = merge_cost.FoldWeights(bytes=7168 * 2048 * 2, matrix_elements=7168 * 2048, extra_bytes=61 * 7168 * 2048 * 2,
                               kv_bytes=100 << 30)
    sizes = dict(tokens=T, heads=h, q_dim=dq, v_dim=dv, dtype_bytes=2)
    choice = merge_cost.choose(costs, **sizes, merge="ag_rs", project="off", fold="auto", fold_weights=w)
    assert choice.fold and choice.merge == "ag_rs" and set(choice.predicted_s) == {"ag_rs", "ag_rs+fold"}
    assert choice.predicted_s["ag_rs+fold"] == pytest.approx(
        choice.predicted_s["ag_rs"] - costs.seconds("reduce_scatter", T * h * dv * 2) + costs.matmul_seconds(
            w.bytes, 2 * T * w.matrix_elements))
    big = dataclasses.replace(w, kv_bytes=w.extra_bytes * 10)  # the fold's weights 10 % of the KV bytes
    choice = merge_cost.choose(costs, **sizes, merge="ag_rs", project="off", fold="auto", fold_weights=big)
    assert not choice.fold and "FOLD_KV_FRACTION" in choice.reason
    choice = merge_cost.choose(costs, **sizes, merge="a2a", project="off", fold="on", fold_weights=big)
    assert choice.fold and choice.merge == "ag_rs"  # asked for: taken (the Q all-gather's merge name)
    assert merge_cost.choose(None, **sizes, fold="on", fold_weights=big).fold  # no measured costs: "on" still folds
    assert not merge_cost.choose(None, **sizes, fold="auto", fold_weights=w).fold
