"""The A2A head merge (`ops.parallel.dcp.merge_heads`, merge "a2a") compiled by Inductor
with a symbolic value width, on 2 gloo ranks (issue 25).

Found in speculative verify graphs: a draft model sharing the target's forward made
Dynamo's automatic dynamic mark the caches' head dim dynamic, so the partials' width
Dv was symbolic. The merge then cut the packed [out | lse] all-to-all buffer at Dv and
dropped the LSE's size-1 dim with `squeeze(-1)`, which a dim of unknown size does not
take under backed size-oblivious symbols (`decorator.no_size_specialisation`, the
mode every compiled step runs in): `cp::lse_combine` got [N, H, T, 1] LSEs and failed
at run time. Here the width is marked dynamic directly; the compiled merge must equal
the eager A2A merge and the eager AG+RS merge (independent collectives and op).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cp_compile.compiler.decorator import no_size_specialisation
from cp_compile.ops.parallel import dcp as D
from cp_compile.base.parallel_layout import Group
from cp_compile.testing.multirank import run_on_ranks

HEADS = 2  # per rank
STEPS = ((13, 16), (5, 16), (3, 8))  # (tokens, value width): both vary without a recompile


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; equal values (the -inf LSE of a head no rank holds keys for) count 0."""
    a, b = a.float(), b.float()
    return torch.where(a == b, torch.zeros_like(a), a - b).abs().max().item()


def _merge_on_rank(rank: int, world: int, dtype: torch.dtype) -> list[tuple[float, float, float, int]]:
    def ctx(merge: str) -> D.DCPContext:
        return D.DCPContext(group=Group(world, rank, dist.group.WORLD.group_name), interleave=1, block_size=4,
                            merge=merge)

    a2a, ag_rs = ctx("a2a"), ctx("ag_rs")
    compiled = torch.compile(lambda out, lse: D.merge_heads(out, lse, a2a, HEADS, dtype), backend="inductor",
                             fullgraph=True)
    results = []
    for T, dv in STEPS:
        g = torch.Generator().manual_seed(100 * T + rank)
        out = torch.randn(T, world * HEADS, dv, generator=g).to(dtype)  # [T, N*H, Dv]
        lse = torch.randn(T, world * HEADS, generator=g)  # [T, N*H]
        lse[0, 0] = float("-inf")  # head 0 of token 0 empty on every rank: out 0, LSE -inf
        lse[1, rank] = float("-inf")  # one empty shard of a head: weighs 0
        torch._dynamo.mark_dynamic(out, 0)
        torch._dynamo.mark_dynamic(out, 2)  # the value width, as the automatic-dynamic cache gave it
        torch._dynamo.mark_dynamic(lse, 0)
        with no_size_specialisation():
            got_out, got_lse = compiled(out, lse)
        ref_out, ref_lse = D.merge_heads(out, lse, ag_rs, HEADS, dtype)
        eager_out, _ = D.merge_heads(out, lse, a2a, HEADS, dtype)
        assert got_out.shape == ref_out.shape == (T, HEADS, dv), (got_out.shape, ref_out.shape)
        assert got_lse.shape == ref_lse.shape == (T, HEADS), (got_lse.shape, ref_lse.shape)
        results.append((_err(got_out, ref_out), _err(got_lse, ref_lse), _err(got_out, eager_out),
                        torch._dynamo.utils.counters["stats"]["unique_graphs"]))
    return results


def test_a2a_merge_inductor_symbolic_value_width():
    per_rank = run_on_ranks(_merge_on_rank, 2, torch.bfloat16, timeout=600)
    for rank, rows in enumerate(per_rank):
        for (T, dv), (err_out, err_lse, err_eager, graphs) in zip(STEPS, rows):
            # bf16 outputs from two merge orders (AG+RS sums bf16 partial products)
            assert err_out <= 2e-2 and err_eager <= 2e-2, (rank, T, dv, err_out, err_eager)
            assert err_lse <= 1e-5, (rank, T, dv, err_lse)
        assert rows[-1][3] == 1, f"rank {rank}: {rows[-1][3]} graphs (one expected: T and Dv are dynamic)"
