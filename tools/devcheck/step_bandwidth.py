"""Step decode_bandwidth: the registered decode kernel's GB/s at the DCP shapes.

GQA: one KV head and 8 * N query heads (a DCP group of N ranks gathers N ranks' 8
heads against one shard), D 128; MLA: 16 and 128 heads of 512 + 64. bf16, pages of 64
keys in a shuffled table, every request at the full context. Bytes: the KV each
request must read once (GQA: K and V rows; MLA: the latent + rope row). The kernel
(`torch.ops.cp.paged_attention_lse` / `mla_partial_attention`) and SDPA are each
captured in a CUDA graph and timed over replays (median, min, max). SDPA runs on the
same keys gathered contiguous (outside the timing), the query heads of the KV head
as the query length ([B, 1, G, D] against [B, 1, ctx, D]: the same math with no GQA
expansion), same scale, outputs compared. The subset (the whole grid of 4 x 3 x 3
GQA and 2 x 3 x 3 MLA points does not fit the step's 80 s with compiles): SUBSET.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tools.devcheck.cases import cache, contiguous, paged_batch
from tools.devcheck.common import (HBM_BYTES_PER_S, Ctx, cp_call, graph_time, max_err, seeded, skipped_timing, tol,
                                   within)
from tools.devcheck.sdpa import pinned_sdpa

# (kind, heads: GQA query heads on the one KV head / MLA heads, batch, context)
SUBSET = [("GQA", 8 * n, 8, 32768) for n in (1, 2, 4, 8)] + [
    ("GQA", 8, 1, 131072), ("GQA", 8, 64, 8192), ("GQA", 64, 64, 32768), ("GQA", 8, 8, 131072),
    ("MLA", 16, 8, 32768), ("MLA", 128, 8, 32768), ("MLA", 16, 64, 8192)]
REHEARSE = [("GQA", 8, 2, 48), ("GQA", 16, 1, 40), ("MLA", 16, 2, 40)]
D, L, R, BLOCK = 128, 512, 64, 64
R_D, R_L, R_R, R_BLOCK = 32, 32, 8, 8  # rehearsal


def _case(ctx: Ctx, kind: str, heads: int, B: int, n: int) -> dict[str, Any]:
    d, l, r, block = (R_D, R_L, R_R, R_BLOCK) if ctx.rehearse else (D, L, R, BLOCK)
    dt, dev = torch.bfloat16, ctx.device
    g = seeded(0, dev)
    p = paged_batch([n] * B, block, dev, g)
    row: dict[str, Any] = {"kind": kind, "heads": heads, "batch": B, "context": n}
    if kind == "GQA":
        q = torch.randn(B, heads, d, device=dev, generator=g).to(dt)
        k, v = cache(p, 1, d, dtype=dt, gen=g, poison=False), cache(p, 1, d, dtype=dt, gen=g, poison=False)
        scale = d ** -0.5
        call = lambda: cp_call(ctx, "paged_attention_lse", q, k, v, p.block_table, p.query_start_loc,  # noqa: E731
                               p.kv_lens, scale)
        kv_bytes = B * n * 2 * d * 2
        qs, kc, vc = q.unsqueeze(1), contiguous(k, p, n).transpose(1, 2), contiguous(v, p, n).transpose(1, 2)
    else:
        qn, qp = torch.randn(B, heads, l, device=dev, generator=g).to(dt), torch.randn(B, heads, r, device=dev,
                                                                                        generator=g).to(dt)
        kv = cache(p, l + r, dtype=dt, gen=g, poison=False)
        scale = (l + r) ** -0.5
        call = lambda: cp_call(ctx, "mla_partial_attention", qn, qp, kv, p.block_table,  # noqa: E731
                               p.query_start_loc, p.kv_lens, scale)
        kv_bytes = B * n * (l + r) * 2
        kc = contiguous(kv, p, n).unsqueeze(1)  # [B, 1, n, L+R]
        qs, vc = torch.cat([qn, qp], -1).unsqueeze(1), kc[..., :l]
    sdpa, backend, refused = pinned_sdpa(qs, kc, vc, scale)
    out = call()[0]
    want = sdpa().squeeze(1)  # [B, heads, Dv]
    err = max_err(out, want)
    row.update(kv_MB=round(kv_bytes / 1e6, 1), sdpa_backend=backend, max_err_vs_sdpa=err,
               tol=tol(dt, dev), ok=within(err, dt, dev))
    if refused:
        row["sdpa_refused"] = refused
    if not ctx.cuda:
        row.update(skipped_timing())
        return row
    roof = ctx.copy_roof_bytes_per_s()
    for name, fn in (("kernel", call), ("sdpa", sdpa)):
        t = graph_time(fn)
        bps = kv_bytes / (t["us"] * 1e-6)
        row.update({f"{name}_us": round(t["us"], 1), f"{name}_us_min_max": [round(t["us_min"], 1),
                                                                          round(t["us_max"], 1)],
                    f"{name}_GBps": round(bps / 1e9, 1), f"{name}_of_4.8TBps": round(bps / HBM_BYTES_PER_S, 3)})
        if roof:
            row[f"{name}_of_copy_roof"] = round(bps / roof, 3)
    return row


def run(ctx: Ctx) -> Iterator[dict[str, Any]]:
    import cp_compile.ops  # noqa: F401

    for kind, heads, B, n in (REHEARSE if ctx.rehearse else SUBSET):
        yield _case(ctx, kind, heads, B, n)
        if ctx.cuda:
            torch.cuda.empty_cache()
