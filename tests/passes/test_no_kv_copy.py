"""A compiled step must never copy a KV cache (docs/architecture.md §10).

A mutated graph input can silently gain a full-size clone (functionalisation) or
an epilogue `copy_`. Measured: the bytes a compiled step allocates (CPU profiler)
must not grow with the cache size. Inductor re-inplaces the cache writes; the
single-device op and the DCP rewrite are both checked. (`aot_eager` does clone the
caches every step: it is a debugging lowering, not a serving one.)
"""

import torch
from torch.profiler import ProfilerActivity, profile

import cp_compile
from cp_compile.testing.multirank import run_on_ranks


class OneLayer(torch.nn.Module):
    def forward(self, q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens, query_start_loc):
        out = torch.ops.cp.gqa_paged_attention(q, k, v, k_cache, v_cache, slot_mapping, block_table, seq_lens,
                                               query_start_loc, 0.125)
        return out * 2


def _step_bytes(compiled, num_blocks: int, dcp: int, rank: int) -> int:
    """Bytes allocated by one warm compiled decode step with a cache of `num_blocks` pages."""
    alloc = cp_compile.BlockAllocator(num_blocks, 16 * dcp)
    cp_compile.build_attention_metadata([(0, 20), (0, 9)], alloc, max_blocks_per_req=4)
    meta = cp_compile.build_attention_metadata([(20, 1), (9, 1)], alloc, max_blocks_per_req=4)
    g = torch.Generator().manual_seed(0)
    T = meta.num_tokens
    k_cache, v_cache = torch.zeros(num_blocks, 16, 1, 64), torch.zeros(num_blocks, 16, 1, 64)
    torch._dynamo.mark_dynamic(k_cache, 0)
    torch._dynamo.mark_dynamic(v_cache, 0)
    q = torch.randn(4 * dcp, T, 64, generator=g)[rank * 4:(rank + 1) * 4].transpose(0, 1)
    args = (q, torch.randn(T, 1, 64, generator=g), torch.randn(T, 1, 64, generator=g), k_cache, v_cache,
            meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc)
    compiled(*args)  # warm (compiles once: num_blocks is dynamic)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        compiled(*args)
    assert k_cache.abs().sum() > 0  # the step really wrote the caches in place
    return sum(e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0)


def _world(rank: int, world: int, dcp: int) -> list[int]:
    cp_compile.init_parallel(cp_compile.CPConfig(tensor_parallel_size=world, decode_context_parallel_size=dcp,
                                                 block_size=16), device="cpu")
    spec = cp_compile.AttentionSpec(kind="gqa", num_heads=4 * world, num_kv_heads=1)  # 4 query heads per rank
    compiled = torch.compile(OneLayer(), backend=cp_compile.backend(lowering="inductor", attention=spec),
                             fullgraph=True)
    return [_step_bytes(compiled, nb, dcp, rank) for nb in (64, 2048)]


def test_compiled_steps_do_not_copy_the_cache():
    for dcp, world in ((1, 1), (2, 2)):
        for small, large in run_on_ranks(_world, world, dcp):
            # 2048 pages of 16 x 64 fp32 = 8 MiB per cache: any copy would show.
            assert large - small < 64 * 1024, (dcp, small, large)
