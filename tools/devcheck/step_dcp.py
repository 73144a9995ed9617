"""Step dcp_emulation: DCP over N = 2 / 4 / 8 ranks emulated on one device.

Every rank's cache shard (the interleaved layout of ops/core/layout.py: virtual
pages of block * N keys, rank r holding its `block` of each), its localised metadata
(`cp::dcp_localize_metadata`), its cache write and its partial attention of all N
ranks' query heads (`cp::paged_attention_lse`, one KV head, 8 query heads per rank)
run on the one device; the partials are merged with the project's merge kernels,
both ways the compositions do (`cp::lse_combine`: the all-to-all merge; `cp::lse_rescale`
summed over ranks: the all-gather + reduce-scatter merge), and compared with the
one-device op (`cp::gqa_paged_attention` on the unsharded cache). Requests include
one-key contexts (most ranks' shards empty) and lengths that end mid-page.

On CUDA the whole N-rank step is captured in one CUDA graph; between replays the
metadata is mutated in place (seq_lens + 1, the new tokens' slots, a block-table
entry moved to a spare page, fresh q / k / v), and each replay is compared with the
same step run eagerly and with the one-device op.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from cp_compile.ops.core import layout
from tools.devcheck.common import Ctx, cp_call, max_err, seeded, tol, within, worst

DEVICE = dict(ranks=(2, 4, 8), lens=[8192, 1, 2, 3, 5000, 777, 64 * 8 + 1, 12000], heads=8, D=128, block=64,
              replays=3, dtype=torch.bfloat16)
REHEARSE = dict(ranks=(2, 4), lens=[1, 7, 30], heads=2, D=16, block=4, replays=2, dtype=torch.float32)
INTERLEAVE = 1


class Emulation:
    """Static tensors of one N-rank decode step (the graph's inputs, mutated in place)."""

    def __init__(self, ctx: Ctx, N: int, s: dict[str, Any]) -> None:
        dev, dt, D, bk = ctx.device, s["dtype"], s["D"], s["block"]
        self.ctx, self.N, self.bk, self.dt = ctx, N, bk, dt
        self.g = seeded(N, dev)
        vbs = bk * N  # virtual page: what the one-device cache uses as its page
        lens = s["lens"]
        B = len(lens)
        width = -(-(max(lens) + s["replays"] + 1) // vbs)
        self.spare = B * width  # pages past every request's: the block-table mutation's targets
        nblocks = B * width + B
        self.bt = torch.randperm(B * width, device=dev, generator=self.g).view(B, width).to(torch.int32)
        self.seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
        self.slots = torch.empty(B, dtype=torch.long, device=dev)
        self.H = N * s["heads"]
        self.q = torch.empty(B, self.H, D, dtype=dt, device=dev)
        self.k_new = torch.empty(B, 1, D, dtype=dt, device=dev)
        self.v_new = torch.empty(B, 1, D, dtype=dt, device=dev)
        self.k_full = torch.randn(nblocks, vbs, 1, D, device=dev, generator=self.g).to(dt)
        self.v_full = torch.randn(nblocks, vbs, 1, D, device=dev, generator=self.g).to(dt)
        off = torch.arange(vbs, device=dev)
        owner = layout.token_owner(off, cp=N, interleave=INTERLEAVE, block_size=bk)
        local = layout.local_offset(off, cp=N, interleave=INTERLEAVE, block_size=bk)
        self.k_shards, self.v_shards = [], []
        for r in range(N):
            mine = owner == r
            ks = torch.empty(nblocks, bk, 1, D, dtype=dt, device=dev)
            vs = torch.empty_like(ks)
            ks[:, local[mine]] = self.k_full[:, off[mine]]
            vs[:, local[mine]] = self.v_full[:, off[mine]]
            self.k_shards.append(ks)
            self.v_shards.append(vs)
        self.scale = D ** -0.5
        self.refresh()

    def refresh(self) -> None:
        """New token values and the slots of position seq - 1 (in place)."""
        vbs = self.bk * self.N
        pos = self.seq.long() - 1
        rows = torch.arange(self.seq.shape[0], device=self.seq.device)
        self.slots.copy_(self.bt.long()[rows, pos // vbs] * vbs + pos % vbs)
        for t in (self.q, self.k_new, self.v_new):
            t.copy_(torch.randn(t.shape, device=t.device, generator=self.g).to(t.dtype))

    def mutate(self, step: int) -> None:
        """The next decode step: every request one longer; request 0's current page moved to a spare one."""
        self.seq.add_(1)
        vbs = self.bk * self.N
        j = (int(self.seq[0]) - 1) // vbs
        self.bt[0, j] = self.spare + step
        self.refresh()

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """All ranks: localise, write, partial; merged both ways -> ([T, H, D], [T, H, D])."""
        c, N = self.ctx, self.N
        outs, lses = [], []
        for r in range(N):
            loc = cp_call(c, "dcp_localize_metadata", self.slots, self.qsl, self.seq, N, r, INTERLEAVE, self.bk)
            cp_call(c, "cache_write", self.k_new, self.k_shards[r], loc[0])
            cp_call(c, "cache_write", self.v_new, self.v_shards[r], loc[0])
            o, lse = cp_call(c, "paged_attention_lse", self.q, self.k_shards[r], self.v_shards[r], self.bt, self.qsl,
                             loc[2], self.scale)
            outs.append(o)
            lses.append(lse)
        a2a = cp_call(c, "lse_combine", torch.stack(outs), torch.stack(lses))[0]  # [T, H, D]
        lse_all = torch.cat([lse.transpose(0, 1) for lse in lses]).contiguous()  # [N*H, T]
        ag_rs = sum(cp_call(c, "lse_rescale", o, lse, lse_all)[0].float() for o, lse in zip(outs, lses))
        return a2a.to(self.dt), ag_rs.to(self.dt)

    def one_device(self) -> torch.Tensor:
        return cp_call(self.ctx, "gqa_paged_attention", self.q, self.k_new, self.v_new, self.k_full, self.v_full,
                       self.slots, self.bt, self.seq, self.qsl, self.scale)


def run(ctx: Ctx) -> Iterator[dict[str, Any]]:
    import cp_compile.ops  # noqa: F401

    s = REHEARSE if ctx.rehearse else DEVICE
    dt = s["dtype"]
    for N in s["ranks"]:
        em = Emulation(ctx, N, s)
        graph = None
        if ctx.cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                em.step()  # Triton JIT outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static = em.step()
        for replay in range(s["replays"]):
            if replay:
                em.mutate(replay)
            if graph is not None:
                graph.replay()
                torch.cuda.synchronize()
                got = tuple(t.clone() for t in static)
            else:
                got = em.step()
            eager = em.step()  # rewrites the same values into the same slots
            want = em.one_device()
            errs = {"a2a_vs_one_device": max_err(got[0], want), "ag_rs_vs_one_device": max_err(got[1], want),
                    "replay_vs_eager": worst([max_err(got[0], eager[0]), max_err(got[1], eager[1])])}
            row = {"ranks": N, "replay": replay, "heads": em.H, "batch": len(s["lens"]),
                   "seq_lens": em.seq.tolist()[:4] + ["..."], "dtype": str(dt).split(".")[1],
                   "captured": graph is not None, **errs, "tol": tol(dt, ctx.device),
                   "ok": all(within(e, dt, ctx.device) for e in errs.values())}
            if graph is None:
                row["graph"] = "skipped: rehearsal on CPU (no CUDA graphs); the replays run eagerly"
            yield row
