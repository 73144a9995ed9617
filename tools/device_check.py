"""The device check: ONE command on a bare GPU machine (issue 36), rehearsed on CPU in CI.

    python3 tools/device_check.py --out DIR        # on the GPU, from the repository root, nothing installed
    python3 tools/device_check.py --rehearse --out DIR   # anywhere: tiny shapes on CPU, TRITON_INTERPRET=1
    python3 tools/device_check.py --dry-run --out DIR    # anywhere (CI): the step plan, and every Triton
                                                         # kernel AOT-compiled for sm_80 / sm_90a
    python -m tools.device_check --plan --json plan.json # anywhere: the decode launches at production
                                                         # shapes, predicted (not measured) bandwidth

It needs torch, triton and this checkout, nothing else: the repository is imported as
laid out (`tools/devcheck/repo_imports.py` maps `cp_compile.ops` / `cp_compile.passes`
to `ops/` / `passes/` when they are not installed); if that cannot work it says why in
one line and exits 2. Each step runs in its own forked process under its own time
limit (a step past it is killed and recorded as timed out; the run goes on), and
`DIR/device_check.json` (+ `.md`) is rewritten after every step. Steps and limits:
STEPS below, docs/kernels.md "Device check". The limits sum to 330 s, so the whole
run with its start stays within 6 minutes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python3 tools/device_check.py` puts tools/ first, not the root
    sys.path.insert(0, str(REPO))


def _steps() -> list:
    from tools.devcheck import step_bandwidth, step_compiled, step_dcp, step_env, step_kernels, step_prefill
    from tools.devcheck.runner import Step

    return [
        Step("env", 15, 60, "GPU, SM count, clocks, versions, device-to-device copy GB/s (the streaming roof)",
             step_env.run),
        Step("kernels", 70, 600, "every cp:: op through torch.ops.cp vs its reference: production shapes (bf16) "
             "and op_cases edges (fp32, bf16); NaN / inf fail", step_kernels.run),
        Step("decode_bandwidth", 70, 300, "decode GB/s at the DCP shapes vs SDPA (flash pinned) on contiguous KV, "
             "same scale, outputs compared, CUDA-graph timed", step_bandwidth.run),
        Step("dcp_emulation", 50, 300, "DCP N = 2 / 4 / 8 on one device: shards, localisation, partials, merge "
             "kernels == the one-device op; one CUDA graph, metadata mutated between replays", step_dcp.run),
        Step("compiled_step", 90, 300, "the cp_ascend-compiled decode step of an example model (validation off) "
             "captured and replayed with mutated metadata vs eager", step_compiled.run),
        Step("prefill", 35, 300, "prefill kernel TFLOPS at 8k / 32k vs SDPA flash, outputs compared",
             step_prefill.run),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "device_check")
    p.add_argument("--rehearse", action="store_true",
                   help="tiny shapes on CPU under TRITON_INTERPRET=1 (CUDA graphs and timing skipped, said why)")
    p.add_argument("--dry-run", action="store_true", help="no GPU: the step plan, and every kernel AOT-compiled")
    p.add_argument("--only", action="append", help="run only these steps (repeat, or comma-separated)")
    p.add_argument("--plan", action="store_true",
                   help="no GPU: the decode kernels' launches at production shapes for an H200 and a predicted "
                        "fraction of 4.8 TB/s (tools/decode_plan.py, docs/kernels.md); nothing runs")
    p.add_argument("--json", type=Path, help="with --plan: write the plan rows here")
    a = p.parse_args(argv)
    if a.rehearse:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    try:
        from tools.devcheck.repo_imports import ensure_repo_importable

        how = ensure_repo_importable()
        import torch

        import cp_compile.ops  # noqa: F401  (registers every cp:: op, the CUDA kernels included)
    except Exception as exc:  # noqa: BLE001  (one line: why the check cannot start)
        print(f"device_check cannot start: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    if a.plan:
        from tools import decode_plan

        return decode_plan.main(["--markdown"] + (["--json", str(a.json)] if a.json else []))
    from tools.devcheck.common import Ctx
    from tools.devcheck.runner import cuda_available_in_child, run_all

    only = {n for o in a.only or [] for n in o.split(",")}
    steps = [s for s in _steps() if not only or s.name in only]
    if a.dry_run:
        from tools.devcheck import dry_run

        return dry_run.main(steps, a.out)
    # This process never touches CUDA (not even is_available: cuInit before a fork breaks
    # CUDA in every child); the steps run in forked children that do.
    if not a.rehearse and not cuda_available_in_child():
        print("device_check: no CUDA device; run with --rehearse (CPU, interpreter) or --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if a.rehearse else "cuda")
    header = {"mode": "rehearse" if a.rehearse else "device", "cp_compile_ops": how,
              "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "limits_s": {s.name: (s.rehearse_limit_s if a.rehearse else s.limit_s) for s in steps}}
    t0 = time.perf_counter()
    ok = run_all(steps, Ctx(device, a.rehearse), a.out, header, lambda m: print(m, flush=True))
    print(f"{'ok' if ok else 'FAILED'} in {time.perf_counter() - t0:.1f} s; wrote {a.out / 'device_check.json'} "
          f"and {a.out / 'device_check.md'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
