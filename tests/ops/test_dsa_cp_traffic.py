"""DSA-CP work and traffic on a long prefill, measured on gloo ranks (docs/dsa_cp.md).

One request of T new tokens (prefill, no context), tp = 2. Per rank and layer:
- indexer scoring work = causal (query row, key) pairs scored: plain TP scores all
  T rows (sum of causal lengths = T(T+1)/2 on every rank); DSA-CP scores its own
  rows only (`shard_row_metadata` kv lengths);
- bytes sent by this rank inside attention, by `CollectiveMeter`: plain TP none;
  DSA-CP the two all-to-alls, (tp-1)/tp of [T_pad, H/tp, L+R] and of [rows, H, L],
  i.e. (tp-1)/tp^2 * T_pad * H * (2L+R) * bytes.
- the indexer-only variant's top-k all-gather: (tp-1) * rows * K * 4 bytes.
The formulas are asserted against the meter, then evaluated at DeepSeek-V3.2 sizes.
"""

from __future__ import annotations

import torch

import cp_compile
from cp_compile.base.comm_stats import CollectiveMeter
from cp_compile.base.config import AttentionSpec
from cp_compile.passes.context import CompileContext
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from cp_compile.ops.core import layout
from cp_compile.ops.parallel import dsa_cp as S
from cp_compile.testing.batches import meta_args
from cp_compile.testing.multirank import run_on_ranks

T = 1023  # odd: one padding row at tp 2
H, L, R, HI, DI, TOPK, BLOCK = 8, 16, 8, 2, 8, 16, 16
SPEC = AttentionSpec("sfa", num_heads=H, has_indexer=True)


def a2a_bytes(t: int, *, tp: int, heads: int, latent: int, rope: int, dtype_bytes: int) -> int:
    """Bytes one rank sends per layer in DSA-CP's two all-to-alls (equal splits)."""
    rows = layout.token_shard_rows(t, tp=tp)
    return (rows * tp * (heads // tp) * (latent + rope) + rows * heads * latent) * dtype_bytes * (tp - 1) // tp


def topk_gather_bytes(t: int, *, tp: int, topk: int) -> int:
    """Bytes one rank sends per layer in the indexer-only variant's top-k all-gather (int32)."""
    return layout.token_shard_rows(t, tp=tp) * topk * 4 * (tp - 1)


def _meta():
    alloc = BlockAllocator(T // BLOCK + 2, BLOCK)
    return build_attention_metadata([(0, T)], alloc)


def _rank(rank: int, world: int) -> dict[str, int]:
    cfg = cp_compile.CPConfig(tensor_parallel_size=world, enable_dsa_cp=True, block_size=BLOCK)
    state = cp_compile.init_parallel(cfg, device="cpu")
    ctx = CompileContext.from_state(state, attention=SPEC).tp_view()
    meta = _meta()
    g = torch.Generator().manual_seed(0)
    hl = H // world
    x = dict(q_nope=torch.randn(T, hl, L, generator=g), q_pe=torch.randn(T, hl, R, generator=g),
             kv_c=torch.randn(T, L, generator=g), k_pe=torch.randn(T, R, generator=g),
             q_i=torch.randn(T, HI, DI, generator=g), k_i=torch.randn(T, DI, generator=g),
             w=torch.rand(T, HI, generator=g))
    nb = meta.block_table.shape[1] + 1

    def caches():
        return torch.zeros(nb, BLOCK, L + R), torch.zeros(nb, BLOCK, DI)

    latent, index_cache = caches()
    with CollectiveMeter() as tp_meter:  # plain TP: the single-device ops on this rank's heads
        topk = torch.ops.cp.lightning_indexer(x["q_i"], x["k_i"], x["w"], index_cache, *meta_args(meta), TOPK)
        torch.ops.cp.sparse_mla_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], latent, *meta_args(meta),
                                          topk, 0.2)
    latent, index_cache = caches()
    with CollectiveMeter() as cp_meter:
        topk = S.dsa_cp_indexer(x["q_i"], x["k_i"], x["w"], index_cache, *meta_args(meta), TOPK, ctx)
        S.dsa_cp_sparse_attention(x["q_nope"], x["q_pe"], x["kv_c"], x["k_pe"], latent, *meta_args(meta), topk,
                                  0.2, ctx)
    with CollectiveMeter() as gather_meter:
        S.all_gather_topk(topk, ctx, T)
    rows = layout.token_shard_rows(T, tp=world)
    _, kv = layout.shard_row_metadata(meta.query_start_loc, meta.seq_lens, rows, tp=world, rank=rank)
    cp_compile.destroy_parallel()
    return dict(tp_bytes=tp_meter.total, cp_bytes=cp_meter.total, cp_calls=sum(cp_meter.calls.values()),
                tp_work=int(layout.causal_lens(meta.query_start_loc, meta.seq_lens, T).long().sum()),
                cp_work=int(kv.long().sum()), rows=rows, gather_bytes=gather_meter.total)


def test_dsa_cp_work_and_bytes_on_a_long_prefill(summary_note):
    world = 2
    res = run_on_ranks(_rank, world, timeout=300)
    want = a2a_bytes(T, tp=world, heads=H, latent=L, rope=R, dtype_bytes=4)
    for r in range(world):
        assert res[r]["tp_bytes"] == 0
        assert (res[r]["cp_bytes"], res[r]["cp_calls"]) == (want, 2), res[r]
        assert res[r]["tp_work"] == T * (T + 1) // 2
        assert res[r]["gather_bytes"] == topk_gather_bytes(T, tp=world, topk=TOPK)
    # Every real row is scored once across the ranks; contiguous shards of a causal
    # prefill are uneven: the last rank has the longest rows.
    assert sum(res[r]["cp_work"] for r in range(world)) == T * (T + 1) // 2
    assert res[world - 1]["cp_work"] > res[0]["cp_work"]
    worst = max(res[r]["cp_work"] for r in range(world)) / res[0]["tp_work"]
    v32 = {t: (a2a_bytes(t, tp=8, heads=128, latent=512, rope=64, dtype_bytes=2),
               topk_gather_bytes(t, tp=8, topk=2048)) for t in (4096, 32768)}
    summary_note(f"DSA-CP work / bytes (prefill T = {T}, tp = {world}): indexer pairs per rank plain TP "
                 f"{res[0]['tp_work']}, DSA-CP " + " / ".join(str(res[r]['cp_work']) for r in range(world))
                 + f" (busiest rank {worst:.2f} of TP); bytes sent per rank per layer in attention plain TP 0, "
                 f"DSA-CP {want} measured = formula (2 all-to-alls), top-k all-gather "
                 f"{res[0]['gather_bytes']}; DeepSeek-V3.2 sizes tp 8 (a2a bf16 / top-k gather int32): "
                 + ", ".join(f"T={t}: {a / 2**20:.0f} / {g / 2**20:.0f} MiB" for t, (a, g) in v32.items()))
