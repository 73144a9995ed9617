"""The prepared device check: run once on the first GPU this project gets (under 10 minutes on one GPU).

    .venv/bin/python tools/device_check.py --out device_check/       # on a CUDA machine
    .venv/bin/python tools/device_check.py --dry-run                 # anywhere (CI): every step printed,
                                                                     # every kernel AOT-compiled for sm_80 / sm_90a
    .venv/bin/python -m tools.device_check --plan --json plan.json   # anywhere: the decode launches at production
                                                                     # shapes, predicted (not measured) bandwidth

Steps (each writes its rows into one JSON, `<out>/device_check.json`, and a
markdown table, `<out>/device_check.md`; a failing step is recorded and the next
one runs):
1. env: GPU, torch, triton, flashinfer (if it imports).
2. aot: every Triton kernel AOT-compiled for sm_80 and sm_90a (tools/aot_cuda_check.py --subset).
3. pytest: the suite's accelerator-marked tests (`pytest -m accelerator`).
4. kernels: every cp:: op's CUDA kernel vs its CPU reference on the same case
   (cp_compile.testing.op_cases) in fp32 / bf16 / fp16.
5. decode_bandwidth: the paged decode kernel (`cp::paged_attention_lse`) at 8k /
   32k / 128k context, achieved HBM GB/s over the KV bytes it must read, beside torch
   SDPA on the same KV (gathered contiguous once, outside the timing) and
   FlashInfer's paged decode when it imports.
6. cuda_graph: capture and replay of a DCP decode step (`dcp_gqa_attention`, world
   of one NCCL rank: localisation, cache write, partial attention, LSE merge and its
   collectives in one graph); replay output == eager output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16", "float16")
TOL = {"float32": 2e-3, "bfloat16": 3e-2, "float16": 1e-2}  # fp32 may run tl.dot in tf32
DECODE_CONTEXTS = (8192, 32768, 131072)
DECODE_SHAPE = dict(batch=8, q_heads=32, kv_heads=8, head_dim=128, block_size=64)  # Llama-3-8B-like, bf16


def _cuda_time(fn: Callable[[], Any], iters: int = 20, warmup: int = 3) -> float:
    """Median seconds per call, CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


# ----------------------------------------------------------------------------- steps


def step_env(dry: bool) -> list[dict]:
    import torch
    import triton

    row = {"torch": torch.__version__, "triton": triton.__version__,
           "gpu": torch.cuda.get_device_name() if not dry else "(dry run: none)"}
    try:
        import flashinfer

        row["flashinfer"] = flashinfer.__version__
    except Exception as exc:  # optional
        row["flashinfer"] = f"not available ({type(exc).__name__})"
    return [row]


def step_aot(dry: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"aot_{os.getpid()}.json"
    proc = subprocess.run([sys.executable, "-m", "tools.aot_cuda_check", "--subset", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-2000:], flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"AOT compile failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}")
    rows = json.loads(out.read_text())["results"]
    out.unlink()
    return [{k: r[k] for k in ("kernel", "arch", "target", "registers", "spill_stores", "smem_dynamic", "status")}
            for r in rows]


def step_pytest(dry: bool) -> list[dict]:
    cmd = [sys.executable, "-m", "pytest", "-m", "accelerator", "-q", "-p", "no:cacheprovider"]
    if dry:
        print(f"would run: {' '.join(cmd)}")
        return [{"command": " ".join(cmd), "status": "dry run"}]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    return [{"command": " ".join(cmd), "rc": proc.returncode, "summary": tail}]


def step_kernels(dry: bool) -> list[dict]:
    import torch

    import cp_compile.ops  # noqa: F401
    from cp_compile.ops.core import registry
    from cp_compile.testing.op_cases import clone_args, flat_outputs, op_cases

    rows = []
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        cases = op_cases("cpu", dtype)
        for op in sorted(cases):
            if dry:
                rows.append({"op": op, "dtype": dtype_name, "status": "dry run"})
                continue
            args, mutated = cases[op]
            dev_args = tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in clone_args(args))
            ref_args = tuple(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                             for a in clone_args(args))
            got = registry.DEVICE_KERNELS[op](*dev_args)
            want = getattr(torch.ops.cp, op.split("::")[1]).default(*ref_args)
            pairs = list(zip(flat_outputs(got), flat_outputs(want)))
            pairs += [(dev_args[i], ref_args[i]) for i in mutated]
            err = 0.0
            for g, w in pairs:
                g = g.cpu()
                if not g.is_floating_point():
                    err = max(err, float((g != w).sum()))
                    continue
                fin = torch.isfinite(w)
                if not torch.equal(torch.isneginf(g), torch.isneginf(w)):
                    err = float("inf")
                elif fin.any():  # relative to the output's scale (the W8A8 outputs reach ~1e2)
                    scale = max(1.0, float(w.float()[fin].abs().max()))
                    err = max(err, float((g.float()[fin] - w.float()[fin]).abs().max()) / scale)
            rows.append({"op": op, "dtype": dtype_name, "max_err_rel_to_scale": err, "ok": err <= TOL[dtype_name]})
    return rows


def _decode_inputs(ctx: int, dtype):
    import torch

    s = DECODE_SHAPE
    B, Hq, Hkv, D, BS = s["batch"], s["q_heads"], s["kv_heads"], s["head_dim"], s["block_size"]
    nb = ctx // BS
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(B * nb, BS, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B * nb, BS, Hkv, D, device="cuda", dtype=dtype, generator=g)
    bt = torch.randperm(B * nb, device="cuda", generator=g).view(B, nb).to(torch.int32)
    q = torch.randn(B, Hq, D, device="cuda", dtype=dtype, generator=g)
    qsl = torch.arange(B + 1, device="cuda", dtype=torch.int32)
    kv_lens = torch.full((B,), ctx, device="cuda", dtype=torch.int32)
    return q, k, v, bt, qsl, kv_lens


def step_decode_bandwidth(dry: bool) -> list[dict]:
    import torch

    rows = []
    for ctx in DECODE_CONTEXTS:
        s = DECODE_SHAPE
        kv_bytes = 2 * s["batch"] * ctx * s["kv_heads"] * s["head_dim"] * 2  # K and V, bf16
        if dry:
            rows.append({"context": ctx, **s, "kv_bytes": kv_bytes, "status": "dry run"})
            continue
        from cp_compile.ops.paged.triton_decode import paged_attention_with_lse_triton

        q, k, v, bt, qsl, kv_lens = _decode_inputs(ctx, torch.bfloat16)
        row = {"context": ctx, **s, "kv_bytes": kv_bytes}
        for name, kw in (("triton", {}), ("triton_dot", dict(use_dot=True, block_h=16, block_n=64))):
            t = _cuda_time(lambda: paged_attention_with_lse_triton(q, k, v, bt, qsl, kv_lens, 0.088, **kw))
            row[f"{name}_us"], row[f"{name}_GBps"] = t * 1e6, kv_bytes / t / 1e9
        # SDPA on the same KV, gathered to [B, Hkv, ctx, D] once (not timed).
        kc = k[bt.long()].flatten(1, 2).transpose(1, 2)  # [B, Hkv, ctx, D]
        vc = v[bt.long()].flatten(1, 2).transpose(1, 2)
        qs = q.unsqueeze(2)  # [B, Hq, 1, D]
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(qs, kc, vc, enable_gqa=True)  # noqa: E731
        t = _cuda_time(sdpa)
        row["sdpa_us"], row["sdpa_GBps"] = t * 1e6, kv_bytes / t / 1e9
        try:
            import flashinfer

            ws = torch.empty(128 * 2**20, dtype=torch.uint8, device="cuda")
            wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
            nb = bt.shape[1]
            indptr = torch.arange(0, s["batch"] * nb + 1, nb, device="cuda", dtype=torch.int32)
            wrapper.plan(indptr, bt.flatten(), torch.full((s["batch"],), s["block_size"], device="cuda",
                                                          dtype=torch.int32),
                         s["q_heads"], s["kv_heads"], s["head_dim"], s["block_size"], data_type=torch.bfloat16)
            t = _cuda_time(lambda: wrapper.run(q, (k, v)))
            row["flashinfer_us"], row["flashinfer_GBps"] = t * 1e6, kv_bytes / t / 1e9
        except Exception as exc:  # optional
            row["flashinfer"] = f"skipped: {type(exc).__name__}: {str(exc)[:120]}"
        rows.append(row)
        del q, k, v, kc, vc
        torch.cuda.empty_cache()
    return rows


def step_cuda_graph(dry: bool) -> list[dict]:
    import torch
    import torch.distributed as dist

    import cp_compile.ops  # noqa: F401
    from cp_compile.ops.parallel.dcp import DCPContext, dcp_gqa_attention
    from cp_compile.base.parallel_layout import Group

    plan = "world of 1 NCCL rank; DCPContext(group of 1); dcp_gqa_attention decode of 8 requests at 4k"
    if dry:
        print(f"would capture: {plan}")
        return [{"step": plan, "status": "dry run"}]
    if not dist.is_initialized():
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=torch.device("cuda", 0))
    ctx = DCPContext(group=Group(1, 0, dist.group.WORLD.group_name), interleave=1, block_size=64)
    q, k_cache, v_cache, bt, qsl, _ = _decode_inputs(4096, torch.bfloat16)
    B = q.shape[0]
    seq = torch.full((B,), 4096, device="cuda", dtype=torch.int32)
    pos = seq.long() - 1
    slots = bt.long()[torch.arange(B, device="cuda"), pos // 64] * 64 + pos % 64
    k_new = torch.randn(B, k_cache.shape[2], k_cache.shape[3], device="cuda", dtype=torch.bfloat16)
    v_new = torch.randn_like(k_new)
    step = lambda: dcp_gqa_attention(q, k_new, v_new, k_cache, v_cache, slots, bt, seq, qsl, 0.088, ctx)  # noqa: E731
    eager = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up on the capture stream (Triton JIT, NCCL comm init)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    graph.replay()
    torch.cuda.synchronize()
    err = float((static_out.float() - eager.float()).abs().max())
    t_graph = _cuda_time(graph.replay)
    t_eager = _cuda_time(step)
    return [{"step": plan, "captured": True, "replay_vs_eager_max_abs_err": err, "ok": err < 1e-2,
             "graph_us": t_graph * 1e6, "eager_us": t_eager * 1e6}]


STEPS: list[tuple[str, Callable[[bool], list[dict]]]] = [
    ("env", step_env), ("aot", step_aot), ("pytest", step_pytest), ("kernels", step_kernels),
    ("decode_bandwidth", step_decode_bandwidth), ("cuda_graph", step_cuda_graph),
]


def table(results: dict[str, Any]) -> str:
    lines = []
    for name, res in results["steps"].items():
        lines.append(f"\n### {name} ({res['status']}, {res['seconds']:.1f} s)\n")
        rows = res.get("rows") or []
        if res.get("error"):
            lines.append("```\n" + res["error"][-1500:] + "\n```")
        if not rows:
            continue
        keys = list(dict.fromkeys(k for r in rows for k in r))
        fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
        lines.append("| " + " | ".join(keys) + " |")
        lines.append("|" + "---|" * len(keys))
        lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="no GPU: print every step, AOT-compile every kernel")
    p.add_argument("--out", type=Path, default=REPO / "device_check")
    p.add_argument("--only", action="append", help="run only these steps")
    p.add_argument("--plan", action="store_true",
                   help="no GPU: the decode kernels' launches at production shapes for an H200 and a predicted "
                        "fraction of 4.8 TB/s (tools/decode_plan.py, docs/kernels.md); nothing runs")
    p.add_argument("--json", type=Path, help="with --plan: write the plan rows here")
    a = p.parse_args(argv)
    if a.plan:
        from tools import decode_plan

        return decode_plan.main(["--markdown"] + (["--json", str(a.json)] if a.json else []))
    import torch

    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run, or on a GPU machine", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"dry_run": a.dry_run, "steps": {}}
    failed = False
    for name, fn in STEPS:
        if a.only and name not in a.only:
            continue
        print(f"== step {name}{' (dry run)' if a.dry_run else ''}: {STEP_DOC[name]}",
              flush=True)
        t0 = time.perf_counter()
        try:
            rows = fn(a.dry_run)
            bad = [r for r in rows if r.get("ok") is False or r.get("status") == "failed"]
            res = {"status": "failed" if bad else "ok", "rows": rows}
        except Exception:
            res = {"status": "failed", "rows": [], "error": traceback.format_exc()}
        res["seconds"] = time.perf_counter() - t0
        failed |= res["status"] != "ok"
        results["steps"][name] = res
        print(f"   {name}: {res['status']} ({len(res['rows'])} rows, {res['seconds']:.1f} s)", flush=True)
        for r in res["rows"][:40]:
            print(f"   {r}", flush=True)
        if res.get("error"):
            print(res["error"][-2000:], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "device_check.json").write_text(json.dumps(results, indent=1, default=str))
    (a.out / "device_check.md").write_text(table(results) + "\n")
    print(f"wrote {a.out / 'device_check.json'} and {a.out / 'device_check.md'}")
    return 1 if failed else 0


STEP_DOC = {
    "env": "GPU, torch, triton, flashinfer versions",
    "aot": "every Triton kernel AOT-compiled for sm_80 and sm_90a (tools/aot_cuda_check.py --subset)",
    "pytest": "the suite's accelerator-marked tests",
    "kernels": "every cp:: op's CUDA kernel vs its CPU reference, fp32 / bf16 / fp16",
    "decode_bandwidth": "paged decode kernel HBM GB/s at 8k / 32k / 128k vs SDPA (and FlashInfer)",
    "cuda_graph": "CUDA-graph capture + replay of a DCP decode step",
}

if __name__ == "__main__":
    sys.exit(main())
