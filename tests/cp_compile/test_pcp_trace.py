"""The PCP compositions trace to a static graph (in one process, no process group).

A future PCP pass records them with proxies, like the DCP pass does; make_fx with
symbolic shapes fails on any data-dependent Python branch or shape, so this pins
that they have none, and counts the collectives each layer adds.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import cp_compile
import cp_compile.ops  # noqa: F401
from cp_compile.ops.core import pcp_layout
from cp_compile.ops.parallel import pcp as P
from cp_compile.base.parallel_layout import Layout


def _setup(dcp: int):
    layout = Layout.for_test(cp_compile.CPConfig(tensor_parallel_size=dcp, decode_context_parallel_size=dcp,
                                                 prefill_context_parallel_size=2, block_size=4), rank=2 * dcp - 1)
    assert (layout.pcp.rank, layout.dcp.rank) == (1, dcp - 1)
    ctx = P.PCPContext(pcp=layout.pcp, dcp=layout.dcp, cp=layout.cp, interleave=1, block_size=4)
    alloc = cp_compile.BlockAllocator(16, 4 * 2 * dcp)
    meta = cp_compile.build_attention_metadata([(0, 7), (3, 5), (0, 1)], alloc, num_padding_tokens=2,
                                               max_blocks_per_req=4)
    row = pcp_layout.pcp_token_table(meta.query_start_loc, meta.num_tokens, pcp=2)[1]
    return ctx, (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc, row), row.numel()


def _histogram(gm) -> dict[str, int]:
    c = collections.Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    return {k: v for k, v in c.items() if "c10d" in k or k.startswith("cp.")}


@pytest.mark.parametrize("kind", ["gqa", "mla"])
@pytest.mark.parametrize("dcp", [1, 2])
def test_pcp_compositions_trace_symbolic(kind, dcp):
    ctx, meta, T_loc = _setup(dcp)
    if kind == "gqa":
        args = (torch.randn(T_loc, 2, 16), torch.randn(T_loc, 1, 16), torch.randn(T_loc, 1, 12),
                torch.zeros(16, 4, 1, 16), torch.zeros(16, 4, 1, 12), *meta)
        fn = lambda *a: P.pcp_gqa_attention(*a, 0.25, ctx)  # noqa: E731
    else:
        args = (torch.randn(T_loc, 2, 16), torch.randn(T_loc, 2, 8), torch.randn(T_loc, 16),
                torch.randn(T_loc, 8), torch.zeros(16, 4, 24), *meta)
        fn = lambda *a: P.pcp_mla_attention(*a, 0.2, ctx)  # noqa: E731
    gm = make_fx(fn, tracing_mode="symbolic")(*args)
    h = _histogram(gm)
    # Per forward: token indices (1 AG). Per layer: new K/V or latent (1 AG), Q over
    # PCP (1 AG), PCP merge (1 AG + 1 RS); with DCP also Q heads (1 AG) and the DCP
    # merge (1 AG + 1 RS).
    assert h["_c10d_functional.all_gather_into_tensor.default"] == (4 if dcp == 1 else 6)
    assert h["_c10d_functional.reduce_scatter_tensor.default"] == (1 if dcp == 1 else 2)
    assert h["cp.dcp_localize_metadata.default"] == 1
    assert h["cp.cache_write.default"] == (2 if kind == "gqa" else 1)
    assert h["cp.lse_combine.default"] == 1


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_pcp_quantised_compositions_trace_symbolic(kind):
    """Over a quantised cache (issue 39, decision 68): still no data-dependent branch; the same
    collectives (the scales add none); every write is `cp::quant_cache_write`, the owner's and
    the new-token part's (the gathered new tokens quantised by the same op)."""
    ctx, meta, T_loc = _setup(2)
    if kind == "gqa":
        args = (torch.randn(T_loc, 2, 16), torch.randn(T_loc, 1, 16), torch.randn(T_loc, 1, 12),
                torch.zeros(16, 4, 1, 16, dtype=torch.int8), torch.zeros(16, 4, 1, 12, dtype=torch.int8), *meta)
        scales = (torch.zeros(16, 4, 1), torch.zeros(16, 4, 1))
        fn = lambda *a: P.pcp_gqa_attention(*a[:-2], 0.25, ctx, k_scale_cache=a[-2], v_scale_cache=a[-1])  # noqa: E731
    else:
        args = (torch.randn(T_loc, 2, 16), torch.randn(T_loc, 2, 8), torch.randn(T_loc, 16),
                torch.randn(T_loc, 8), torch.zeros(16, 4, 24, dtype=torch.float8_e4m3fn), *meta)
        scales = (torch.zeros(16, 4, 1),)
        fn = lambda *a: P.pcp_mla_attention(*a[:-1], 0.2, ctx, kv_scale_cache=a[-1])  # noqa: E731
    gm = make_fx(fn, tracing_mode="symbolic")(*args, *scales)
    h = _histogram(gm)
    assert h["_c10d_functional.all_gather_into_tensor.default"] == 6
    assert h["_c10d_functional.reduce_scatter_tensor.default"] == 2
    assert h["cp.quant_cache_write.default"] == (4 if kind == "gqa" else 2)
    assert "cp.cache_write.default" not in h
    assert h["cp.lse_combine.default"] == 1
