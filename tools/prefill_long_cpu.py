"""Long-prompt prefill attention on CPU: the Triton kernel (interpreter) runs where the reference cannot.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python tools/prefill_long_cpu.py --tokens 16384 --cap-gib 3

Runs `cp::varlen_causal_attention_lse`'s CPU reference and the flash-style Triton
kernel (`ops/kernels/varlen_attention.py`, under TRITON_INTERPRET=1) on the same
one-request prompt, each in a child process whose address space is capped at
`--cap-gib` GiB above what the child holds after its imports (RLIMIT_AS). The
reference builds an [Hq, T, T] fp32 score tensor (4 GiB per head at T = 16384, plus
its exp) and fails; the kernel holds O(T) and runs. Its output is checked against
exact fp32 attention recomputed for `--check-rows` rows spread over the prompt
(one [Hq, rows, T] score tensor). OPENBLAS_NUM_THREADS=1: the interpreter's small
numpy matmuls are ~500x slower with OpenBLAS threads on a loaded machine.
Prints one JSON line per side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _child(side: str, tokens: int, heads: int, dim: int, cap_gib: float, check_rows: int, block: int) -> dict:
    import resource

    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    import cp_compile.ops  # noqa: F401
    from cp_compile.ops.kernels.varlen_attention import varlen_attention_lse_triton

    g = torch.Generator().manual_seed(0)
    q = torch.randn(tokens, heads, dim, generator=g)
    k = torch.randn(tokens, 1, dim, generator=g)
    v = torch.randn(tokens, 1, dim, generator=g)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    scale = dim ** -0.5
    # Cap the address space at what the process maps now plus cap_gib.
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + int(cap_gib * 2**30)
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))  # soft limit: lifted again for the check
    t0 = time.perf_counter()
    row = {"side": side, "tokens": tokens, "heads": heads, "head_dim": dim, "cap_gib_above_imports": cap_gib}
    try:
        if side == "reference":
            out, lse = torch.ops.cp.varlen_causal_attention_lse(q, k, v, qsl, scale)
        else:
            out, lse = varlen_attention_lse_triton(q, k, v, qsl, scale, block_m=block, block_n=block)
    except (MemoryError, RuntimeError) as exc:  # torch reports a failed allocation as RuntimeError
        row.update(status="failed", error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        row["seconds"] = round(time.perf_counter() - t0, 1)
        return row
    row["seconds"] = round(time.perf_counter() - t0, 1)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    rows = torch.linspace(0, tokens - 1, check_rows).long()
    s = torch.einsum("rhd,nd->hrn", q[rows], k[:, 0]) * scale  # [Hq, rows, T]
    s = s.masked_fill(torch.arange(tokens)[None, None, :] > rows[None, :, None], float("-inf"))
    want_lse = torch.logsumexp(s, -1)  # [Hq, rows]
    want = torch.einsum("hrn,nd->rhd", torch.exp(s - want_lse[..., None]), v[:, 0])
    row.update(status="ran", checked_rows=check_rows,
               max_abs_err_out=float((out[rows] - want).abs().max()),
               max_abs_err_lse=float((lse[rows] - want_lse.T).abs().max()))
    row["ok"] = row["max_abs_err_out"] < 1e-4 and row["max_abs_err_lse"] < 1e-4
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cap-gib", type=float, default=3.0)
    p.add_argument("--check-rows", type=int, default=64)
    p.add_argument("--block", type=int, default=512, help="BLOCK_M = BLOCK_N of the kernel")
    p.add_argument("--side", choices=["reference", "kernel"], help=argparse.SUPPRESS)  # child mode
    a = p.parse_args(argv)
    if a.side:
        print(json.dumps(_child(a.side, a.tokens, a.heads, a.head_dim, a.cap_gib, a.check_rows, a.block)))
        return 0
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    ok = True
    for side in ("reference", "kernel"):
        cmd = [sys.executable, __file__, "--side", side, "--tokens", str(a.tokens), "--heads", str(a.heads),
               "--head-dim", str(a.head_dim), "--cap-gib", str(a.cap_gib), "--check-rows", str(a.check_rows),
               "--block", str(a.block)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")), None)
        print(line or json.dumps({"side": side, "status": "crashed", "rc": proc.returncode,
                                  "stderr": proc.stderr[-500:]}), flush=True)
        row = json.loads(line) if line else {}
        ok &= (row.get("status") == "failed") if side == "reference" else bool(row.get("ok"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
