"""The pcp_attention pass on Dynamo graphs in one process: structure only.

Numerics of the rewritten graphs are checked on gloo ranks in test_pcp_model.py; here
the graph is inspected: which passes run per batch kind, what replaces the attention
nodes, the collectives per layer and per forward, the output put back at the global
token count (a traced size, not a constant), and the refusals.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cp_compile.base.config import AttentionSpec, ConfigError, CPConfig
from cp_compile.passes.context import CompileContext
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.ops.core import pcp_layout
from cp_compile.passes.fx_utils import fake_value
from cp_compile.ops.pcp.ops import pcp_token_index
from cp_compile.base.parallel_layout import Group
from cp_compile.passes.pcp_attention import token_index_markers
from cp_compile.passes.pass_manager import PassManager
from cp_compile.testing.pass_harness import run_pipeline

LAYERS, H, D, L, R = 2, 4, 8, 16, 4
BLOCK, NUM_BLOCKS = 4, 8
cp = torch.ops.cp


class Attn(nn.Module):
    """`LAYERS` single-device attention layers between linears (GQA or MLA)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        width = H * (L if kind == "mla" else D)
        self.proj = nn.ModuleList(nn.Linear(width, width) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor, caches: list[torch.Tensor], meta) -> torch.Tensor:
        args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc)
        T = x.shape[0]
        for i in range(LAYERS):
            q = self.proj[i](x).view(T, H, -1)
            if self.kind == "gqa":
                o = cp.gqa_paged_attention(q, q[:, :1], q[:, :1], caches[2 * i], caches[2 * i + 1], *args, 0.5)
            else:
                o = cp.mla_attention(q, q[..., :R], q[:, 0], q[:, 0, :R], caches[i], *args, 0.5)
            x = o.reshape(T, -1)
        return x


def _graph_inputs(kind: str, pcp: int = 2, marked: bool = True):
    """(fn, args) as the compiled entry traces a PCP prefill step: this rank's token
    indices as an argument, marked with `cp::pcp_token_index` (unless not `marked`),
    token rows taken inside the graph. The argument's name is not the entry's (the
    pass must not depend on it)."""
    model = Attn(kind)
    meta = build_attention_metadata([(0, 7), (4, 5), (0, 1)], BlockAllocator(NUM_BLOCKS, BLOCK * pcp),
                                    num_padding_tokens=2)
    if kind == "gqa":
        caches = [torch.zeros(NUM_BLOCKS, BLOCK, 1, D) for _ in range(2 * LAYERS)]
    else:
        caches = [torch.zeros(NUM_BLOCKS, BLOCK, L + R) for _ in range(LAYERS)]
    x = torch.randn(meta.num_tokens, H * (L if kind == "mla" else D))
    ti = pcp_layout.pcp_token_table(meta.query_start_loc, meta.num_tokens, pcp=pcp)[1].contiguous()

    def step(my_rows: torch.Tensor, x: torch.Tensor, caches, meta):
        rows = pcp_token_index(my_rows)
        return model(x[rows.clamp(min=0)], caches, meta)

    def unmarked(cp_pcp_token_index: torch.Tensor, x: torch.Tensor, caches, meta):
        # The name the pass used to match (before issue 20), without the marker.
        return model(x[cp_pcp_token_index.clamp(min=0)], caches, meta)

    for t in (ti, x, *(getattr(meta, f) for f in ("slot_mapping", "query_start_loc", "seq_lens"))):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    return (step if marked else unmarked), (ti, x, caches, meta)


def _capture(fn, args) -> torch.fx.GraphModule:
    """The Dynamo graph of fn(*args), not run: unmodified it would hand the
    single-device op T_loc queries with metadata for T tokens (only the pass makes it
    runnable), so this backend keeps the graph and returns a stand-in."""
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return lambda *a: (torch.zeros(1),)

    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True)(*args)
    assert len(graphs) == 1
    return graphs[0]


def _run_pipeline(fn, args, ctx: CompileContext):
    gm = _capture(fn, args)
    pm = PassManager.for_context(ctx)
    pm(gm)
    return pm, gm


def _ctx(kind: str, dcp: int = 1, batch_kind: str | None = "prefill") -> CompileContext:
    spec = AttentionSpec(kind=kind, num_heads=2 * H, num_kv_heads=1)
    cfg = CPConfig(tensor_parallel_size=2, decode_context_parallel_size=dcp, prefill_context_parallel_size=2,
                   block_size=BLOCK)
    return CompileContext.for_test(cfg, rank=1, attention=spec, batch_kind=batch_kind)


@pytest.mark.parametrize("kind,dcp", [("gqa", 1), ("mla", 2), pytest.param("gqa", 2, marks=pytest.mark.slow),
                                      pytest.param("mla", 1, marks=pytest.mark.slow)])
def test_pcp_pass_rewrites_prefill_graph(kind, dcp):
    fn, args = _graph_inputs(kind)
    gm = _capture(fn, args)
    # The token index is the tensor the marker's one call takes (a placeholder), not its size.
    (marker,) = token_index_markers(gm)
    ti = marker.args[0]
    assert ti.op == "placeholder" and isinstance(fake_value(ti), torch.Tensor) and fake_value(ti).dim() == 1
    pm = PassManager.for_context(_ctx(kind, dcp))
    pm(gm)
    assert pm.names == ["pcp_attention", "unsharded_attention_check"]
    rec = pm.history[0]
    op = "cp.gqa_paged_attention" if kind == "gqa" else "cp.mla_attention"
    assert rec.before[op] == LAYERS and op not in rec.after
    assert rec.rewrites == LAYERS + 1  # the layers and the one per-token output
    after = rec.after
    # Per forward: token-index AG and one output AG; per layer: new K/V (latent), Q over PCP, LSE (PCP
    # merge), and with DCP the Q head gather and the DCP merge's LSE gather.
    per_layer = 3 + (2 if dcp > 1 else 0)
    assert after["_c10d_functional.all_gather_into_tensor.default"] == 2 + LAYERS * per_layer
    assert after["_c10d_functional.reduce_scatter_tensor.default"] == LAYERS * (2 if dcp > 1 else 1)
    assert after["cp.dcp_localize_metadata.default"] == 1  # one pcp_step per graph
    assert after["cp.cache_write.default"] == LAYERS * (2 if kind == "gqa" else 1)
    # Sizes from the graph at run time (sym_size), not the traced numbers baked in.
    assert after.get("aten.sym_size.int", 0) >= 1
    missing = [n.name for n in gm.graph.nodes if n.op in ("call_function", "call_method")
               and "example_value" not in n.meta]
    assert missing == []
    # The output has the global token count (slot_mapping's symbol), not T_loc.
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, (tuple, list)) else out
    slot = next(n for n in gm.graph.nodes if n.op == "placeholder" and "slot_mapping" in n.name
                and isinstance(fake_value(n), torch.Tensor))
    got, want = fake_value(out).shape[0], fake_value(slot).shape[0]
    assert isinstance(got, torch.SymInt) and got.node.expr == want.node.expr
    assert token_index_markers(gm) == []  # the marker is gone: it reaches no lowering
    assert fake_value(ti).shape[0].node.expr != want.node.expr


@pytest.mark.parametrize("kind,dcp", [("gqa", 1), ("mla", 2)])
def test_pcp_fresh_prefill_graph_has_no_context_part(kind, dcp):
    """The graph of fresh steps (no request has cached context, issue 26): per layer only the new K/V
    (latent) all-gather and the new-token attention; no Q gather over PCP or DCP, no context attention,
    no LSE gather / rescale / reduce-scatter / combine. The general graph's counts are in the test above."""
    fn, args = _graph_inputs(kind)
    pm, gm = _run_pipeline(fn, args, _ctx(kind, dcp, batch_kind="fresh_prefill"))
    assert pm.names == ["pcp_attention", "unsharded_attention_check"]
    rec = pm.history[0]
    assert rec.rewrites == LAYERS + 1
    after = rec.after
    # Per forward: the token-index AG and the output AG; per layer: the new K/V (latent) AG only.
    assert after["_c10d_functional.all_gather_into_tensor.default"] == 2 + LAYERS
    for gone in ("_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_to_all_single.default",
                 "cp.lse_rescale.default", "cp.lse_combine.default"):
        assert gone not in after, (gone, after)
    part = "cp.paged_attention_lse.default" if kind == "gqa" else "cp.mla_partial_attention.default"
    assert after[part] == LAYERS  # the new-token part only (the general graph: 2 per layer)
    assert after["cp.cache_write.default"] == LAYERS * (2 if kind == "gqa" else 1)
    assert after["cp.dcp_localize_metadata.default"] == 1


def test_pcp_decode_graph_runs_dcp_over_the_cache_ranks():
    # Decode graphs keep every token: dcp_attention over N = pcp * dcp ranks (the CP group).
    ctx = _ctx("gqa", dcp=2, batch_kind="decode")
    assert ctx.cp_view().group == Group(4, 3, "test_cp")
    model = Attn("gqa")
    meta = build_attention_metadata([(5, 1), (2, 1)], BlockAllocator(NUM_BLOCKS, BLOCK * 4))
    caches = [torch.zeros(NUM_BLOCKS, BLOCK * 4, 1, D) for _ in range(2 * LAYERS)]
    pm, gm = run_pipeline(model, (torch.randn(meta.num_tokens, H * D), caches, meta), ctx)
    assert pm.names == ["dcp_attention", "unsharded_attention_check"]
    assert pm.history[0].rewrites == LAYERS
    loc = next(n for n in gm.graph.nodes if "dcp_localize_metadata" in str(n.target))
    assert loc.args[3:5] == (4, 3)  # N = pcp * dcp, rank = cp rank


def test_prefill_graph_without_token_index_is_refused():
    model = Attn("gqa")
    meta = build_attention_metadata([(0, 5)], BlockAllocator(NUM_BLOCKS, BLOCK * 2))
    caches = [torch.zeros(NUM_BLOCKS, BLOCK * 2, 1, D) for _ in range(2 * LAYERS)]
    with pytest.raises(ConfigError, match=r"prefill graph with 0 calls of cp::pcp_token_index.*compile_model"):
        run_pipeline(model, (torch.randn(5, H * D), caches, meta), _ctx("gqa"))
    # An argument named as the entry's used to be, without the marker: refused too (no name coupling).
    fn, args = _graph_inputs("gqa", marked=False)
    with pytest.raises(ConfigError, match=r"prefill graph with 0 calls of cp::pcp_token_index"):
        _run_pipeline(fn, args, _ctx("gqa"))

