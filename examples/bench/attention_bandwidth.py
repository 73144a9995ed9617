"""How close the CPU attention ops come to reading the KV once (issue 26).

    .venv/bin/python -m examples.bench.attention_bandwidth                  # decode, 16k and 32k
    .venv/bin/python -m examples.bench.attention_bandwidth --prefill 16384  # + one causal prefill

Decode at a real per-rank GQA shape (Qwen3-235B at tp 8: 8 query heads, 1 KV head,
head_dim 128), batch 8, block size 16, one thread. Per context, in every round each
method runs once, the order reversed every other round (ABBA), so a round's methods
see the same machine load; a figure is the median over rounds with min / max:

- `sum`: `k.sum() + v.sum()` over the same KV laid out contiguously: one plain read,
  the bandwidth limit the others are a fraction of (`% read-once`, per round);
- `sdpa`: torch's CPU flash kernel (`aten._scaled_dot_product_flash_attention_for_cpu`,
  with LSE) on that contiguous KV, the GQA heads folded into the query rows;
- `fma floor`: the FLOPs this decode must do (4 per query row x key x head dim), as
  independent AVX2 FMAs with no memory traffic (`cpu_decode.fma_floor`): the time no
  kernel can beat on this core; at this shape its `% read-once` is the compute ceiling;
- `op in place`: `cp::paged_attention_lse` over the paged cache, block table as a fresh
  allocator hands it out (each request's pages consecutive); on CPU with AVX2 this is
  the C decode kernel of `ops/paged/cpu_decode.c`;
- `op gathered`: the same op with the pages shuffled over the cache;
- `torch in place` / `torch gathered`: the op's pure-torch kernel (`CP_COMPILE_CPU_DECODE=torch`:
  flash chunks over a strided view / over gathered chunks), what ran before the C kernel;
- `reference`: `paged_reference.paged_attention_with_lse`, the oracle the op replaced on CPU.

GB/s is the KV bytes of the batch over the time. `x sdpa` is the method's time over
sdpa's in the same round. The load average and commit are printed with the table
and written to the JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch

import cp_compile.ops  # noqa: F401  (registers torch.ops.cp.*)
from cp_compile.ops.paged import cpu_decode
from cp_compile.ops.core import paged_cache
from cp_compile.ops.paged import reference as paged_reference

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _ms(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def decode_methods(context: int, batch: int, hq: int, hkv: int, d: int, bs: int, dtype: torch.dtype,
                   with_reference: bool, seed: int = 0) -> tuple[dict[str, Callable[[], object]], int]:
    """The methods of one decode config, and the KV bytes each must read."""
    if context <= 0 or context % bs:
        raise ValueError(f"--context {context}: each request is whole pages here; pass a positive multiple of "
                         f"--block-size {bs}")
    g = torch.Generator().manual_seed(seed)
    nb = context // bs
    n_pages = batch * nb + 1
    k_cache = torch.randn(n_pages, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(n_pages, bs, hkv, d, generator=g).to(dtype)
    in_place = (torch.arange(batch * nb) + 1).view(batch, nb).int()
    shuffled = (torch.randperm(batch * nb, generator=g) + 1).view(batch, nb).int()
    q = torch.randn(batch, hq, d, generator=g).to(dtype)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    kv_lens = torch.full((batch,), context, dtype=torch.int32)
    scale = d ** -0.5
    # The same KV, contiguous per request: [B, Hkv, S, D]; GQA heads folded into the rows.
    k_flat = paged_cache.gather_request_pages(k_cache, in_place.flatten(), batch * context).view(batch, context, hkv, d)
    v_flat = paged_cache.gather_request_pages(v_cache, in_place.flatten(), batch * context).view(batch, context, hkv, d)
    k_bhsd, v_bhsd = k_flat.transpose(1, 2).contiguous(), v_flat.transpose(1, 2).contiguous()
    q_fold = q.view(batch, hkv, hq // hkv, d)
    op = torch.ops.cp.paged_attention_lse
    flops = 4 * batch * hq * context * d
    methods: dict[str, Callable[[], object]] = {
        "sum": lambda: (k_bhsd.sum(), v_bhsd.sum()),
        "fma floor": lambda: cpu_decode.fma_floor(flops),
        "sdpa": lambda: _flash(q_fold, k_bhsd, v_bhsd, scale=scale),
        "op in place": lambda: op(q, k_cache, v_cache, in_place, qsl, kv_lens, scale),
        "op gathered": lambda: op(q, k_cache, v_cache, shuffled, qsl, kv_lens, scale),
        "torch in place": lambda: _torch_kernel(op, q, k_cache, v_cache, in_place, qsl, kv_lens, scale),
        "torch gathered": lambda: _torch_kernel(op, q, k_cache, v_cache, shuffled, qsl, kv_lens, scale),
    }
    if with_reference:
        methods["reference"] = lambda: paged_reference.paged_attention_with_lse(q, k_cache, v_cache, in_place, qsl,
                                                                          kv_lens, scale)
    return methods, 2 * batch * context * hkv * d * k_cache.element_size()


def _torch_kernel(op, *args):
    """The op with its C decode kernel switched off (the pure-torch kernel of cpu_attention)."""
    os.environ["CP_COMPILE_CPU_DECODE"] = "torch"
    try:
        return op(*args)
    finally:
        del os.environ["CP_COMPILE_CPU_DECODE"]


def run_rounds(methods: dict[str, Callable[[], object]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """ms per method per round, ABBA order."""
    names = list(methods)
    for _ in range(warmup):
        for n in names:
            methods[n]()
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            times[n].append(_ms(methods[n]))
    return times


def decode_rows(times: dict[str, list[float]], kv_bytes: int, context: int) -> list[dict]:
    rows = []
    for name, ms in times.items():
        gbs = [kv_bytes / (t * 1e-3) / 1e9 for t in ms]
        rows.append({"op": name, "context": context, "ms": _spread(ms), "gb_per_s": _spread(gbs),
                     "pct_read_once": _spread([100 * s / t for s, t in zip(times["sum"], ms)]),
                     "x_sdpa": _spread([t / s for t, s in zip(ms, times["sdpa"])])})
    return rows


def prefill_row(T: int, hq: int, hkv: int, d: int, dtype: torch.dtype, bs: int = 16) -> dict:
    """One causal prefill of T tokens through `cp::paged_attention_lse` (the DCP prefill's
    partial attention: the T tokens in a paged cache, query t reading keys 0..t; flash over
    page chunks, O(T) memory) beside SDPA's causal flash kernel on the same q/k/v (heads
    repeated), once each."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(T, hq, d, generator=g).to(dtype)
    k = torch.randn(T, hkv, d, generator=g).to(dtype)
    v = torch.randn(T, hkv, d, generator=g).to(dtype)
    nb = -(-T // bs)  # pages of one request, consecutive (a fresh allocator's table)
    pad = nb * bs - T
    k_cache = torch.cat([k, k.new_zeros(pad, hkv, d)]).view(nb, bs, hkv, d)
    v_cache = torch.cat([v, v.new_zeros(pad, hkv, d)]).view(nb, bs, hkv, d)
    table = torch.arange(nb, dtype=torch.int32)[None]
    qsl = torch.tensor([0, T], dtype=torch.int32)
    kv_lens = torch.arange(1, T + 1, dtype=torch.int32)  # causal: token t reads keys 0..t
    op_ms = _ms(lambda: torch.ops.cp.paged_attention_lse(q, k_cache, v_cache, table, qsl, kv_lens, d ** -0.5))
    rep = hq // hkv
    qb = q.transpose(0, 1)[None]
    kb = k.repeat_interleave(rep, dim=1).transpose(0, 1)[None].contiguous()
    vb = v.repeat_interleave(rep, dim=1).transpose(0, 1)[None].contiguous()
    sdpa_ms = _ms(lambda: _flash(qb, kb, vb, is_causal=True, scale=d ** -0.5))
    return {"op": "paged_attention_lse (causal prefill)", "tokens": T, "op_ms": op_ms, "sdpa_ms": sdpa_ms,
            "x_sdpa": op_ms / sdpa_ms}


def _fmt(s: dict[str, float], f: str = "{:.2f}") -> str:
    return f"{f.format(s['median'])} ({f.format(s['min'])}–{f.format(s['max'])})"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", default="16384,32768")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-reference", action="store_true", help="skip the slow reference")
    ap.add_argument("--prefill", type=int, default=0, help="also one causal prefill of this many tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="results/attention_bandwidth")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    load0 = os.getloadavg()[0]
    rows: list[dict] = []
    for ctx in (int(c) for c in a.context.split(",")):
        methods, kv_bytes = decode_methods(ctx, a.batch, a.heads, a.kv_heads, a.head_dim, a.block_size, dtype,
                                           not a.no_reference)
        rows += decode_rows(run_rounds(methods, a.rounds), kv_bytes, ctx)
        del methods
    prefill = prefill_row(a.prefill, a.heads, a.kv_heads, a.head_dim, dtype) if a.prefill else None
    load1 = os.getloadavg()[0]
    meta = {"commit": commit(), "c_decode_kernel": cpu_decode.library() is not None, "load_avg_start": load0, "load_avg_end": load1, "rounds": a.rounds,
            "threads": a.threads, "shape": dict(batch=a.batch, heads=a.heads, kv_heads=a.kv_heads,
                                                head_dim=a.head_dim, block_size=a.block_size, dtype=a.dtype)}
    print(f"commit {meta['commit']}, load average {load0:.1f} -> {load1:.1f}, {a.rounds} rounds (ABBA), "
          f"{a.threads} thread(s), batch {a.batch}, {a.heads} q / {a.kv_heads} kv heads x {a.head_dim}, {a.dtype}")
    print("| op | context | ms | GB/s | % of read-once | x sdpa |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['op']} | {r['context']} | {_fmt(r['ms'], '{:.1f}')} | {_fmt(r['gb_per_s'])} | "
              f"{_fmt(r['pct_read_once'], '{:.0f}')} | {_fmt(r['x_sdpa'])} |")
    if prefill:
        print(f"prefill {prefill['tokens']} tokens: op {prefill['op_ms']:.0f} ms, sdpa causal "
              f"{prefill['sdpa_ms']:.0f} ms, x sdpa {prefill['x_sdpa']:.2f} (one run each)")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_bandwidth.json").write_text(json.dumps({"meta": meta, "decode": rows, "prefill": prefill},
                                                             indent=1))


if __name__ == "__main__":
    main()
