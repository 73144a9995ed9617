"""The o_proj pass on Dynamo graphs in one process (structure only; numerics on gloo ranks
in test_o_proj_dsa_cp.py / test_o_proj_layer.py).

A two-layer TP block (MLA attention op -> row-parallel o_proj -> column / row-parallel
MLP) is captured by a backend that runs `OProjDSACPPass` on a context whose TP group
is a real one-rank gloo group named like the graph's all-reduces (tp = 2 in the
context; the rewritten graph is inspected, never run). Without the dsa_cp pass in
front, the o_proj is inferred from the attention op itself.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

import cp_compile
from cp_compile.base.config import AttentionSpec, ConfigError, CPConfig
from cp_compile.base.parallel_layout import Group, Layout
from cp_compile.passes.context import CompileContext, resolve_roles
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.passes.fx_utils import count_ops, fake_value
from cp_compile.passes.o_proj_dsa_cp import OProjDSACPPass
from examples.models.common import ColumnParallelLinear, RowParallelLinear

H, L, R, HID, LAYERS, BLOCK = 1, 4, 2, 6, 2, 4  # local heads (tp 2: 2 in all)


class Block(nn.Module):
    def __init__(self, group) -> None:
        super().__init__()
        self.q = nn.ModuleList(nn.Linear(HID, H * (L + R)) for _ in range(LAYERS))
        self.o_proj = nn.ModuleList(RowParallelLinear(2 * H * L, HID, 2, 0, tp_group=group) for _ in range(LAYERS))
        self.up = nn.ModuleList(ColumnParallelLinear(HID, 8, 2, 0) for _ in range(LAYERS))
        self.down = nn.ModuleList(RowParallelLinear(8, HID, 2, 0, tp_group=group) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], meta) -> torch.Tensor:
        T = x.shape[0]
        for i in range(LAYERS):
            q = self.q[i](x).view(T, H, L + R)
            o = torch.ops.cp.mla_attention(q[..., :L].contiguous(), q[..., L:].contiguous(), q[:, 0, :L].contiguous(),
                                           q[:, 0, L:].contiguous(), caches[i], meta.slot_mapping, meta.block_table,
                                           meta.seq_lens, meta.query_start_loc, 0.5)  # [T, H, L]
            x = x + self.o_proj[i](o.reshape(T, H * L))
            x = x + self.down[i](F.silu(self.up[i](x)))
        return x


@pytest.fixture(scope="module")
def group():
    """A one-rank gloo group for this module only (torn down after it)."""
    if dist.is_initialized():
        pytest.fail("a default process group is already initialised in the test process")
    store = dist.HashStore()
    dist.init_process_group("gloo", rank=0, world_size=1, store=store)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _run_pass(model: nn.Module, group, roles=()) -> dict:
    """Capture model's graph (T dynamic), run the pass in the backend, return what it did."""
    meta = build_attention_metadata([(0, 5), (0, 4)], BlockAllocator(8, BLOCK))
    caches = [torch.zeros(8, BLOCK, L + R) for _ in range(LAYERS)]
    cfg = CPConfig(tensor_parallel_size=2, enable_dsa_cp=True, block_size=BLOCK)
    ctx = CompileContext(config=cfg, layout=Layout(tp=Group(2, 0, group.group_name)), roles=roles, batch_kind="prefill",
                         attention=AttentionSpec("sfa", 2 * H, has_indexer=True))
    seen: dict = {}

    def backend(gm, example_inputs):
        keep = copy.deepcopy(gm)  # the unmodified graph runs; the rewritten one is only inspected
        seen["before"] = count_ops(gm)
        env = next(v.fake_mode.shape_env for v in map(fake_value, gm.graph.nodes) if isinstance(v, FakeTensor))
        guards_before = len(env.guards)
        seen["rewrites"] = OProjDSACPPass(ctx)(gm)
        seen["guards"] = [str(g.expr) for g in env.guards[guards_before:]]
        seen["after"] = count_ops(gm)
        # A SymInt of the trace baked into a node would be a constant for one T only.
        seen["symints"] = [n.format_node() for n in gm.graph.nodes
                           if any(isinstance(a, torch.SymInt) for a in _flat(n.args, n.kwargs))]
        return keep.forward

    torch._dynamo.reset()
    x = torch.randn(meta.num_tokens, HID)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(model, backend=backend, fullgraph=True)(x, caches, meta)
    return seen


def _flat(args, kwargs) -> list:
    out: list = []
    torch.fx.node.map_aggregate((args, kwargs), lambda a: out.append(a) or a)
    return out


def _count(hist: dict, needle: str) -> int:
    return sum(v for k, v in hist.items() if needle in k)


def test_o_proj_is_inferred_from_the_attention_op_and_the_mlp_is_kept(group):
    seen = _run_pass(Block(group), group)
    assert seen["rewrites"] == LAYERS  # the two o_projs, not the two MLP down projections
    before, after = seen["before"], seen["after"]
    assert _count(before, "all_reduce") == 2 * LAYERS and _count(after, "all_reduce") == LAYERS
    assert _count(after, "all_to_all_single") == LAYERS
    assert _count(after, "all_gather_into_tensor") == 2 * LAYERS  # weight + output per layer
    assert _count(after, "mla_attention") == LAYERS  # attention is not this pass's business
    assert seen["symints"] == []
    # Guards the rewrite adds to the frame: at most T <= T_pad (always true). A view
    # splitting the padded token dim would add rows != 1 and recompile steps with T <= tp.
    assert all("<=" in g for g in seen["guards"]), seen["guards"]


def test_declared_role_is_used_and_a_wrong_one_is_refused(group):
    model = Block(group)
    seen = _run_pass(model, group, roles=resolve_roles(model, {"o_proj": "o_proj.1"}))
    assert seen["rewrites"] == 1 and _count(seen["after"], "all_reduce") == 2 * LAYERS - 1
    with pytest.raises(Exception) as err:
        _run_pass(model, group, roles=resolve_roles(model, {"o_proj": "q"}))
    cause = getattr(err.value, "inner_exception", err.value)  # Dynamo wraps what a backend raises
    assert isinstance(cause, ConfigError), err.value
    assert "o_proj='q'" in str(cause) and "q.0.weight" in str(cause)


def test_pass_runs_only_in_dsa_cp_prefill_graphs():
    spec = AttentionSpec("sfa", 4, has_indexer=True)
    on = CPConfig(tensor_parallel_size=2, enable_dsa_cp=True, block_size=4)
    assert OProjDSACPPass.is_enabled(CompileContext.for_test(on, attention=spec, batch_kind="prefill"))
    for ctx in (CompileContext.for_test(on, attention=spec, batch_kind="decode"),
                CompileContext.for_test(on, attention=spec, batch_kind=None),
                CompileContext.for_test(CPConfig(tensor_parallel_size=2, block_size=4), attention=spec,
                                        batch_kind="prefill")):
        assert not OProjDSACPPass.is_enabled(ctx)
    assert cp_compile  # the package is importable as the tests use it
