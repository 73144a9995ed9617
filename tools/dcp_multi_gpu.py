"""A real DCP decode step and the decode bandwidth bench across ranks (issue 36 item 6).

    torchrun --standalone --nproc-per-node 2 tools/dcp_multi_gpu.py                 # 2+ GPUs: NCCL, bf16, 32k context
    torchrun --standalone --nproc-per-node 2 tools/dcp_multi_gpu.py --device cpu    # anywhere: gloo, tiny shapes

One GPU cannot host two NCCL ranks of one communicator, so the one-GPU device check
emulates DCP in one process (tools/devcheck/step_dcp.py); this script runs it for
real. Every rank builds the same global batch (same seed): B decode requests, the
unsharded cache, all ranks' query heads (8 per rank on one KV head, D 128). Each
rank keeps its shard of the cache (the interleaved layout, pages of `block` keys),
and calls `dcp_gqa_attention` (cp_compile/ops/parallel/dcp.py: localisation, cache
write, the query all-gather, the partial over its shard, the LSE merge over real
collectives) with each merge (`ag_rs`, `a2a`); its heads' output is compared with
the one-device op (`cp::gqa_paged_attention` on the unsharded cache). Then the bench:
each rank times the whole DCP step and its partial attention alone (CUDA events
over warm calls on the GPU; on CPU the times are printed but mean nothing), and GB/s
counts the KV bytes of its shard. Rank 0 prints one JSON line with every rank's
rows; the exit code is 1 if any rank's output is off.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _time_us(fn, cuda: bool, iters: int) -> float:
    import torch

    _complete(fn())
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            _complete(fn())
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        else:
            t0 = time.perf_counter()
            _complete(fn())
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _complete(out: object) -> None:
    """Wait for a functional collective's result (an AsyncCollectiveTensor until read): the
    CPU time then includes it, and no collective is still in flight at the teardown (an
    unwaited gloo collective at destroy_process_group aborted a rank under load)."""
    if hasattr(out, "wait"):
        out.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--batch", type=int)
    p.add_argument("--context", type=int)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    from tools.devcheck.repo_imports import ensure_repo_importable

    ensure_repo_importable()
    import torch
    import torch.distributed as dist

    import cp_compile.ops  # noqa: F401
    from cp_compile.base.parallel_layout import Group
    from cp_compile.ops.core import layout
    from cp_compile.ops.parallel.dcp import DCPContext, dcp_gqa_attention, localize

    cuda = a.device == "cuda"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    dt = torch.bfloat16 if cuda else torch.float32
    B = a.batch or (8 if cuda else 3)
    n = a.context or (32768 if cuda else 40)
    Hq, D, bk = (8, 128, 64) if cuda else (2, 16, 4)
    N = world
    vbs = bk * N
    g = torch.Generator().manual_seed(0)  # the same global batch on every rank
    lens = [n] * (B - 2) + [1, n // 3 + 5]  # a one-key request (most shards empty) and one ending mid-page
    width = -(-max(lens) // vbs)
    nblocks = B * width
    bt = torch.randperm(nblocks, generator=g).view(B, width).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    pos = seq.long() - 1
    slots = bt.long()[torch.arange(B), pos // vbs] * vbs + pos % vbs
    q_all = torch.randn(B, N * Hq, D, generator=g).to(dt)
    k_new, v_new = torch.randn(B, 1, D, generator=g).to(dt), torch.randn(B, 1, D, generator=g).to(dt)
    k_full = torch.randn(nblocks, vbs, 1, D, generator=g).to(dt)
    v_full = torch.randn(nblocks, vbs, 1, D, generator=g).to(dt)
    off = torch.arange(vbs)
    mine = layout.token_owner(off, cp=N, interleave=1, block_size=bk) == rank
    loc = layout.local_offset(off, cp=N, interleave=1, block_size=bk)
    k_shard = torch.empty(nblocks, bk, 1, D, dtype=dt)
    v_shard = torch.empty_like(k_shard)
    k_shard[:, loc[mine]], v_shard[:, loc[mine]] = k_full[:, off[mine]], v_full[:, off[mine]]
    to = lambda *ts: [t.to(dev) for t in ts]  # noqa: E731
    bt, seq, qsl, slots, q_all, k_new, v_new, k_full, v_full, k_shard, v_shard = to(
        bt, seq, qsl, slots, q_all, k_new, v_new, k_full, v_full, k_shard, v_shard)
    scale = D ** -0.5
    want = torch.ops.cp.gqa_paged_attention(q_all, k_new, v_new, k_full, v_full, slots, bt, seq, qsl, scale)
    want = want[:, rank * Hq:(rank + 1) * Hq].float().cpu()  # [B, Hq, D]: this rank's heads
    q = q_all[:, rank * Hq:(rank + 1) * Hq].contiguous()
    group = Group(N, rank, dist.group.WORLD.group_name)
    tol = 2e-2 if dt == torch.bfloat16 else 1e-5
    rows = []
    for merge in ("ag_rs", "a2a"):
        ctx = DCPContext(group=group, interleave=1, block_size=bk, merge=merge)
        step = lambda: dcp_gqa_attention(q, k_new, v_new, k_shard, v_shard, slots, bt, seq, qsl, scale, ctx)  # noqa: E731
        got = step().float().cpu()
        err = float((got - want).abs().max()) / max(1.0, float(want.abs().max()))
        ok = bool(err <= tol) and bool(torch.isfinite(got).all())
        local_md = localize(ctx, slots, qsl, seq)
        # the gathered heads (one KV head: rank-major = KV-head-major), as the composition attends them
        partial = lambda: torch.ops.cp.paged_attention_lse(q_all, k_shard, v_shard, bt, qsl,  # noqa: E731
                                                           local_md.causal_lens, scale)
        shard_bytes = int(local_md.seq_lens.sum()) * 2 * D * dt.itemsize
        t_step, t_part = _time_us(step, cuda, a.iters), _time_us(partial, cuda, a.iters)
        rows.append({"rank": rank, "merge": merge, "device": str(dev), "max_err_vs_one_device": err, "tol": tol,
                     "ok": ok, "step_us": round(t_step, 1), "partial_us": round(t_part, 1),
                     "shard_MB": round(shard_bytes / 1e6, 2),
                     "partial_GBps": round(shard_bytes / (t_part * 1e-6) / 1e9, 2),
                     "timing": "CUDA events" if cuda else "CPU wall clock: the path runs, the figure means nothing"})
    gathered: list = [None] * world
    dist.all_gather_object(gathered, rows)
    ok = all(r["ok"] for rs in gathered for r in rs)
    if rank == 0:
        print(json.dumps({"world": world, "batch": B, "context": n, "q_heads_per_rank": Hq, "D": D, "block": bk,
                          "dtype": str(dt).split(".")[1], "ok": ok, "rows": [r for rs in gathered for r in rs]}),
              flush=True)
    dist.barrier()  # every rank's work done before either tears the group down
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
