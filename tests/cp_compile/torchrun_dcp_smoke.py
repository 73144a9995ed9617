"""Launched by torchrun from test_torchrun.py: init_parallel from env:// and one DCP decode."""

import sys

import torch

import cp_compile
from cp_compile.passes.context import CompileContext
from cp_compile.ops.parallel import dcp as D


def main() -> None:
    # The composition is called directly (no compiled graph, so no pass to resolve dcp_merge="auto"):
    # an explicit merge, as ops/parallel/dcp.merge_heads asks.
    cfg = cp_compile.CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2, block_size=4, dcp_merge="ag_rs")
    state = cp_compile.init_parallel(cfg)  # no process group yet: initialised from torchrun's env
    alloc = cp_compile.BlockAllocator(4, 8)
    meta = cp_compile.build_attention_metadata([(0, 6)], alloc)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(6, 4, 8, generator=g), torch.randn(6, 1, 8, generator=g), torch.randn(6, 1, 8, generator=g)
    args = (meta.slot_mapping, meta.block_table, meta.seq_lens, meta.query_start_loc, 0.3)
    ref = torch.ops.cp.gqa_paged_attention(q, k, v, torch.zeros(4, 8, 1, 8), torch.zeros(4, 8, 1, 8), *args)
    r = state.layout.tp.rank
    out = D.dcp_gqa_attention(q[:, 2 * r:2 * r + 2], k, v, torch.zeros(4, 4, 1, 8), torch.zeros(4, 4, 1, 8), *args,
                              CompileContext.from_state(state).cp_view())
    torch.testing.assert_close(out, ref[:, 2 * r:2 * r + 2], atol=1e-5, rtol=1e-5)
    print(f"rank {state.rank} backend={state.backend} dcp_rank={state.layout.dcp.rank} OK", flush=True)
    cp_compile.destroy_parallel(destroy_process_group=True)


if __name__ == "__main__":
    sys.exit(main())
