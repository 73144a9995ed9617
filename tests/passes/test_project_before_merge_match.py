"""Project before the merge (issue 37), in one process: the matcher's proofs and refusals,
the DCP pass's decision, and the cost model's candidates.

Numerics on real gloo ranks: tests/passes/test_project_before_merge.py.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import cp_compile
from cp_compile.base import merge_cost
from cp_compile.base.comm_stats import decode_comm_bytes_per_layer
from cp_compile.passes.pass_manager import PassManager
from cp_compile.passes.projection_match import find_projection
from cp_compile.passes.query_replication import parameter_value
from tests.passes.test_pipeline import H, L, LAYERS, R, _ctx, _inputs

DV = 4  # V head dim: L = 16 = 4 x DV, DeepSeek's 512 / 128
cp = torch.ops.cp


class MLAOut(nn.Module):
    """`LAYERS` MLA layers whose latent output goes through W_UV [H, L, DV] (`variant`: what
    comes between the attention and o_proj)."""

    def __init__(self, variant: str = "ok") -> None:
        super().__init__()
        self.variant = variant
        self.q_proj = nn.ModuleList(nn.Linear(H * L, H * L) for _ in range(LAYERS))
        self.w_uv = nn.ParameterList(nn.Parameter(torch.randn(H, L, DV)) for _ in range(LAYERS))
        self.o_proj = nn.ModuleList(nn.Linear(H * DV, H * L) for _ in range(LAYERS))
        # "view": W_UV sliced out of a kv_b_proj-like weight [H * (3 + DV), L], as the HF engine does.
        self.kv_b = nn.ParameterList(nn.Parameter(torch.randn(H * (3 + DV), L)) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], meta: cp_compile.AttentionMetadata):
        args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc)
        T = x.shape[0]
        for i in range(LAYERS):
            q = self.q_proj[i](x).view(T, H, L)
            o = cp.mla_attention(q, q[..., :R], q[:, 0], q[:, 0, :R], caches[i], *args, 0.5)  # [T, H, L]
            w = self.w_uv[i]
            if self.variant == "gelu":  # non-linear between the attention and the projection
                o = torch.nn.functional.gelu(o)
            if self.variant == "computed":  # the weight is not a parameter (computed from one)
                w = w * 2
            if self.variant == "sum_heads":  # not per head: sums over the heads
                v = torch.einsum("thl,hlv->tv", o, w).repeat(1, H)
            elif self.variant == "view":
                v = torch.einsum("thl,hvl->thv", o, self.kv_b[i].view(H, 3 + DV, L)[:, 3:])
            else:
                v = torch.einsum("thl,hlv->thv", o, w)  # [T, H, DV]
            if self.variant == "two_readers":  # the latent is read besides the projection
                v = v + o[..., :DV]
            x = self.o_proj[i](v.reshape(T, H * DV))
        return x


def _attention_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and "mla_attention" in str(n.target)]


class _Stop(Exception):
    pass


def in_backend(model: nn.Module, fn) -> object:
    """`fn(gm)` inside the backend call: Dynamo's parameter placeholders carry their real
    values (`grapharg`) only there, as they do when the cp_ascend backend runs the passes.
    The graph is not run (the rewritten one names process groups that do not exist)."""
    out = {}

    def backend(gm, example_inputs):
        try:
            out["value"] = fn(gm)
        except Exception as e:  # noqa: BLE001 - handed back to the test
            out["error"] = e
        raise _Stop

    torch._dynamo.reset()
    with pytest.raises(Exception):
        torch.compile(model, backend=backend, fullgraph=True, dynamic=True)(*_inputs("mla"))
    if "error" in out:
        raise out["error"]
    return out["value"]




def _analyse(ctx):
    """In one backend call (one compile): the matcher on the fresh graph, the pipeline under
    "on" (raises before rewriting, or None), then under "auto" (its pass manager)."""
    on = dataclasses.replace(ctx, config=dataclasses.replace(ctx.config, dcp_project_before_merge="on"))

    def fn(gm):
        found = [find_projection(n, H) for n in _attention_nodes(gm)]
        try:
            PassManager.for_context(on)(gm)
            on_error = None
        except cp_compile.ConfigError as e:
            on_error = e
        pm = PassManager.for_context(ctx)
        pm(gm)
        return found, on_error, pm

    return fn


def test_the_projection_is_proven_on_the_mla_pattern() -> None:
    """Proven on every layer; without a process group (no init_parallel) the other ranks' W_UV
    cannot be gathered: not projected, the decision says why, the projection pass is not enabled."""
    found, on_error, pm = in_backend(MLAOut(), _analyse(_ctx("mla", 2, "auto")))
    assert len(found) == LAYERS
    for proj in found:
        assert not isinstance(proj, str), proj
        assert proj.out_dim == DV and proj.head_axis == 0 and proj.equation == "thl,hlv->thv"
    assert on_error is not None and "no process group" in str(on_error)
    assert "project_before_merge" not in pm.names
    assert "no process group" in pm.history[0].decision["not_projectable"]


def test_a_view_of_a_parameter_is_proven_and_rebuilt_per_rank() -> None:
    """W_UV sliced out of a parameter (HF's kv_b_proj): proven, and the slice re-run on a value of
    the parameter gives the operand (what every rank's gathered parameter goes through)."""
    model = MLAOut("view")

    def fn(gm):
        out = []
        for n in _attention_nodes(gm):
            proj = find_projection(n, H)
            assert not isinstance(proj, str), proj
            out.append((proj.equation, proj.head_axis, proj.out_dim, len(proj.views),
                        proj.weight_of(parameter_value(proj.parameter))))
        return out

    found = in_backend(model, fn)
    assert len(found) == LAYERS
    for i, (eq, axis, dv, views, w) in enumerate(found):
        assert (eq, axis, dv) == ("thl,hvl->thv", 0, DV) and views >= 2
        assert torch.equal(w, model.kv_b[i].view(H, 3 + DV, L)[:, 3:])


@pytest.mark.parametrize("variant,why", [
    ("gelu", "not a per-head einsum projection"),
    ("computed", "not a parameter"),
    ("sum_heads", "must keep \\[T, H\\]"),
    ("two_readers", "has 2 readers"),
])
def test_refused_where_not_provable(variant: str, why: str) -> None:
    """Each refusal names why; through the DCP pass it is kept in the decision ("auto") or is a
    ConfigError naming the fix ("on")."""
    found, on_error, pm = in_backend(MLAOut(variant), _analyse(_ctx("mla", 2, "auto")))
    assert isinstance(found[0], str) and re.search(why, found[0]), found[0]
    assert on_error is not None and re.search(f"dcp_project_before_merge='on'.*{why}.*'auto'", str(on_error))
    assert pm.history[0].name == "dcp_attention"
    decision = pm.history[0].decision
    assert not decision.get("project") and re.search(why, decision["not_projectable"])


SIZES = dict(tokens=8, heads=16, q_dim=576, v_dim=512, dtype_bytes=2)  # MLA R1 per rank at tp 8
PW = merge_cost.ProjectionWeights(bytes=2 * 16 * 512 * 128, matrix_elements=16 * 512 * 128, out_dim=128)


def _costs(per_byte: float = 1e-9, matmul: float = 0.0) -> merge_cost.CollectiveCosts:
    lat = {k: 1e-5 for k in merge_cost.KINDS}
    return merge_cost.CollectiveCosts(lat, {k: per_byte for k in lat}, group_size=2, backend="test",
                                      matmul_s_per_weight_byte=matmul, matmul_s_per_flop=0.0)


def test_projected_candidates_move_the_v_head_dim_and_pay_the_projection() -> None:
    c = _costs(matmul=1e-9)
    for merge in ("ag_rs", "a2a"):
        want = (merge_cost.predict(c, merge, **dict(SIZES, v_dim=128)) + (2 - 1) * PW.bytes * 1e-9)
        assert merge_cost.predict(c, merge, **SIZES, projection=PW) == pytest.approx(want)
        # Free matmuls: projecting only saves bytes (a smaller reduce-scatter / all-to-all).
        assert merge_cost.predict(_costs(), merge, **SIZES, projection=PW) < merge_cost.predict(_costs(), merge, **SIZES)
    # The a2a output merge at the R1 shape: [out | lse] bytes 4x smaller (bf16: 260 / 1028 per head and token).
    a2a = decode_comm_bytes_per_layer(8, 16, 0, 512, 2, 2, "a2a")
    a2a_p = decode_comm_bytes_per_layer(8, 16, 0, 128, 2, 2, "a2a")
    assert a2a_p / a2a <= 0.3


def test_auto_picks_the_cheapest_pair_and_explicit_values_narrow_it() -> None:
    cheap = merge_cost.choose(_costs(matmul=1e-12), **SIZES, projection=PW)
    assert cheap.project and set(cheap.predicted_s) == {"ag_rs", "a2a", "ag_rs+project", "a2a+project"}
    dear = merge_cost.choose(_costs(matmul=1e-3), **SIZES, projection=PW)
    assert not dear.project and dear.predicted_s[dear.merge + "+project"] > dear.predicted_s[dear.merge]
    off = merge_cost.choose(_costs(matmul=1e-12), **SIZES, projection=PW, project="off")
    assert not off.project and set(off.predicted_s) == {"ag_rs", "a2a"}
    on = merge_cost.choose(_costs(matmul=1e-3), **SIZES, projection=PW, merge="ag_rs", project="on")
    assert on.project and on.merge == "ag_rs" and set(on.predicted_s) == {"ag_rs+project"}
    none = merge_cost.choose(_costs(matmul=1e-12), **SIZES)
    assert not none.project and "project-before-merge not a candidate" in none.reason
