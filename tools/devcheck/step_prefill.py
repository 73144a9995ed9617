"""Step prefill: the paged prefill kernel's TFLOPS at 8k / 32k vs SDPA flash.

One request of n tokens, causal, GQA 32 query heads on 4 KV heads (8 per KV head),
D 128, bf16, pages of 64 keys, through `torch.ops.cp.paged_attention_lse` (the launcher
takes its query-tiled prefill kernel at >= 4 tokens per request). FLOPs: 4 * Hq * D *
sum of the causal lengths (QK^T and PV). SDPA runs flash on the same keys contiguous
(K / V repeated to the query heads outside the timing: flash's GQA support varies by
version), same scale, outputs compared; both CUDA-graph timed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tools.devcheck.cases import cache, contiguous, paged_batch
from tools.devcheck.common import Ctx, cp_call, graph_time, max_err, seeded, skipped_timing, tol, within
from tools.devcheck.sdpa import pinned_sdpa

DEVICE = dict(tokens=(8192, 32768), hq=32, hkv=4, D=128, block=64, dtype=torch.bfloat16)
# fp32 in the rehearsal: the interpreter's tl.dot reads bf16 operands as integers (docs/kernels.md)
REHEARSE = dict(tokens=(24,), hq=4, hkv=2, D=16, block=8, dtype=torch.float32)


def run(ctx: Ctx) -> Iterator[dict[str, Any]]:
    import cp_compile.ops  # noqa: F401

    s = REHEARSE if ctx.rehearse else DEVICE
    dev, dt, Hq, Hkv, D = ctx.device, s["dtype"], s["hq"], s["hkv"], s["D"]
    for n in s["tokens"]:
        g = seeded(n, dev)
        p = paged_batch([n], s["block"], dev, g)
        q = torch.randn(n, Hq, D, device=dev, generator=g).to(dt)
        k, v = cache(p, Hkv, D, dtype=dt, gen=g, poison=False), cache(p, Hkv, D, dtype=dt, gen=g, poison=False)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
        kv_lens = torch.arange(1, n + 1, dtype=torch.int32, device=dev)  # causal: token i attends i + 1 keys
        scale = D ** -0.5
        call = lambda: cp_call(ctx, "paged_attention_lse", q, k, v, p.block_table, qsl, kv_lens, scale)[0]  # noqa: E731
        rep = Hq // Hkv
        kc = contiguous(k, p, n)[0].transpose(0, 1).repeat_interleave(rep, 0)[None]  # [1, Hq, n, D]
        vc = contiguous(v, p, n)[0].transpose(0, 1).repeat_interleave(rep, 0)[None]
        sdpa, backend, refused = pinned_sdpa(q.transpose(0, 1)[None], kc, vc, scale, causal=True)
        err = max_err(call(), sdpa()[0].transpose(0, 1))
        flops = 4 * Hq * D * n * (n + 1) / 2
        row: dict[str, Any] = {"tokens": n, "q_heads": Hq, "kv_heads": Hkv, "D": D, "dtype": str(dt).split(".")[1], "GFLOP": round(flops / 1e9, 1),
                               "sdpa_backend": backend, "max_err_vs_sdpa": err, "tol": tol(dt, dev),
                               "ok": within(err, dt, dev)}
        if refused:
            row["sdpa_refused"] = refused
        if not ctx.cuda:
            row.update(skipped_timing())
        else:
            for name, fn in (("kernel", call), ("sdpa", sdpa)):
                t = graph_time(fn, iters=10)
                row.update({f"{name}_us": round(t["us"], 1),
                            f"{name}_us_min_max": [round(t["us_min"], 1), round(t["us_max"], 1)],
                            f"{name}_TFLOPS": round(flops / (t["us"] * 1e-6) / 1e12, 1)})
        yield row
        del q, k, v, kc, vc
        if ctx.cuda:
            torch.cuda.empty_cache()
