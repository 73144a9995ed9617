"""Memory and traffic of DCP, measured: KV bytes per rank and bytes on the wire."""

import pytest
import torch

import cp_compile
from cp_compile.base.comm_stats import CollectiveMeter, decode_comm_bytes_per_layer
from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel import dcp as D
from cp_compile.testing.multirank import run_on_ranks


@pytest.mark.parametrize("dcp", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", ["gqa", "mla", "sfa"])
def test_kv_bytes_per_rank_are_one_over_dcp(dcp, kind):
    spec = cp_compile.KVCacheSpec(num_layers=3, kind=kind, head_dim=64, v_head_dim=64, num_kv_heads_per_rank=1,
                                  latent_dim=576, index_dim=128)
    base_cfg = cp_compile.CPConfig(tensor_parallel_size=8, block_size=16 * dcp)
    cfg = cp_compile.CPConfig(tensor_parallel_size=8, decode_context_parallel_size=dcp, block_size=16)
    base = cp_compile.allocate_kv_cache(base_cfg, spec, num_blocks=10, dtype=torch.bfloat16)
    mine = cp_compile.allocate_kv_cache(cfg, spec, num_blocks=10, dtype=torch.bfloat16)
    # Same token capacity (10 virtual blocks of 16*dcp tokens), 1/dcp of the bytes on each rank.
    assert mine.tokens_per_rank * dcp == base.tokens_per_rank
    assert mine.sharded_bytes * dcp == base.sharded_bytes
    # The indexer cache is replicated: same bytes as without DCP.
    assert mine.replicated_bytes == base.replicated_bytes
    assert (mine.replicated_bytes > 0) == (kind == "sfa")


def _measure(rank, world, cases):
    out = []
    for kind, dcp, merge, dtype in cases:
        cfg = cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=dcp, block_size=4,
                                  dcp_merge=merge)
        st = cp_compile.init_parallel(cfg, device="cpu")
        ctx = CompileContext.from_state(st).cp_view()
        alloc = cp_compile.BlockAllocator(8, 4 * dcp)
        cp_compile.build_attention_metadata([(0, 6), (0, 3), (0, 9)], alloc)
        meta = cp_compile.build_attention_metadata([(6, 1), (3, 1), (9, 1)], alloc)
        T, H = meta.num_tokens, 2
        args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc, 0.3)
        local = D.localize(ctx, meta.slot_mapping, meta.query_start_loc, meta.seq_lens)
        with CollectiveMeter() as meter:
            if kind == "gqa":
                D.dcp_gqa_attention(torch.randn(T, H, 32).to(dtype), torch.randn(T, 1, 32).to(dtype),
                                    torch.randn(T, 1, 16).to(dtype), torch.zeros(8, 4, 1, 32, dtype=dtype),
                                    torch.zeros(8, 4, 1, 16, dtype=dtype), *args, ctx, local)
            elif kind == "mla":
                D.dcp_mla_attention(torch.randn(T, H, 32).to(dtype), torch.randn(T, H, 8).to(dtype),
                                    torch.randn(T, 32).to(dtype), torch.randn(T, 8).to(dtype),
                                    torch.zeros(8, 4, 40, dtype=dtype), *args, ctx, local)
            else:  # SFA: the same wire format as MLA; the top-k rides on no collective (replicated indexer)
                topk = torch.tensor([[0, 3, 5, -1]] * T, dtype=torch.int32)
                D.dcp_sfa_attention(torch.randn(T, H, 32).to(dtype), torch.randn(T, H, 8).to(dtype),
                                    torch.randn(T, 32).to(dtype), torch.randn(T, 8).to(dtype),
                                    torch.zeros(8, 4, 40, dtype=dtype), *args[:4], topk, args[4], ctx, local)
        out.append((meter.total, dict(meter.calls)))
        cp_compile.destroy_parallel()
    return out


def test_decode_bytes_match_the_model():
    cases = [(k, d, m, dt) for k in ("gqa", "mla", "sfa") for d in (2, 4) for m in ("ag_rs", "a2a")
             for dt in (torch.float32, torch.bfloat16)]
    res = run_on_ranks(_measure, 4, cases)
    for i, (kind, dcp, merge, dtype) in enumerate(cases):
        q_dim, v_dim = (32, 16) if kind == "gqa" else (40, 32)
        want = decode_comm_bytes_per_layer(3, 2, q_dim, v_dim, torch.empty(0, dtype=dtype).element_size(), dcp,
                                           merge)
        for rank in range(4):
            total, calls = res[rank][i]
            assert total == want, (kind, dcp, merge, dtype, rank, calls)
            assert ("all_to_all" in calls) == (merge == "a2a")
            # Collectives per layer: one Q gather (MLA / SFA fuse [q_nope | q_pe]) and the merge's.
            want_calls = {"all_gather": 2, "reduce_scatter": 1} if merge == "ag_rs" else \
                {"all_gather": 1, "all_to_all": 1}
            assert calls == want_calls, (kind, dcp, merge, calls)
