"""What every step shares: the run's context, the comparison, the kernel call through
dispatch, and CUDA-graph timing.

Device vs rehearsal. On the GPU every cp:: op is called as `torch.ops.cp.<op>` on CUDA
tensors: the dispatcher picks the registered CUDA kernel, the same path a model takes.
In the rehearsal (`--rehearse`: CPU tensors, TRITON_INTERPRET=1) a plain call would
dispatch to the CPU kernels, so `cp_call` redispatches to the CUDA key instead: the
kernel registered for CUDA (the family's launcher, its Triton kernel under the
interpreter) runs on the CPU tensors. Both go through the op's registration, so a
helper's change to a launcher or kernel flows into the check.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 1e-2}  # relative to the output's scale
CUDA_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak


@dataclass
class Ctx:
    """One run: where it runs, and what earlier steps found (env's copy roof)."""

    device: torch.device
    rehearse: bool
    prior: dict[str, Any] = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def copy_roof_bytes_per_s(self) -> float | None:
        for row in self.prior.get("env", {}).get("rows", []):
            if row.get("d2d_copy_GBps"):
                return row["d2d_copy_GBps"] * 1e9
        return None


def cp_call(ctx: Ctx, op: str, *args: Any) -> Any:
    """`torch.ops.cp.<op>(*args)` through dispatch; in the rehearsal, to the CUDA kernel."""
    overload = getattr(torch.ops.cp, op).default
    if ctx.cuda:
        return overload(*args)
    return overload.redispatch(CUDA_KEYS, *args)


def reference(op: str) -> Callable[..., Any]:
    """The op's torch reference (its body: the oracle the suite checks every kernel against)."""
    from cp_compile.ops.core.catalog import OPS

    return {d.name: d.op._init_fn for d in OPS}[f"cp::{op}"]


def max_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |got - want| relative to max(1, |want|max) over want's finite entries.
    NaN (never "fine"): any non-finite value in got where want is finite, or a
    different pattern of -inf / +inf / NaN. Integers: the count of differing entries."""
    got, want = got.detach().cpu(), want.detach().cpu()
    if got.shape != want.shape:
        return math.nan
    if not got.is_floating_point():
        return float((got != want.to(got.dtype)).sum())
    g, w = got.float(), want.float()
    fin = torch.isfinite(w)
    if not torch.equal(torch.isfinite(g), fin) or not torch.equal(torch.isnan(g), torch.isnan(w)) \
            or not torch.equal(g[torch.isinf(w)], w[torch.isinf(w)]):
        return math.nan
    if not fin.any():
        return 0.0
    scale = max(1.0, float(w[fin].abs().max()))
    return float((g[fin] - w[fin]).abs().max()) / scale


def worst(errs: list[float]) -> float:
    """The largest error, NaN if any is NaN (`max(err, nan)` would keep err)."""
    return math.nan if any(math.isnan(e) for e in errs) else max(errs, default=0.0)


# fp32 on CUDA: tl.dot runs tf32 (10-bit mantissa) unless a kernel asks for
# input_precision="ieee", which none does; 1e-5 holds under the interpreter only.
TF32_TOL = 2e-3


def tol(dtype: torch.dtype, device: torch.device) -> float:
    return TF32_TOL if dtype == torch.float32 and device.type == "cuda" else TOL[dtype]


def within(err: float, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> bool:
    """False for NaN (NaN <= tol is False) and for inf."""
    return bool(err <= tol(dtype, device))


def flat(result: Any) -> list[torch.Tensor]:
    if result is None:  # an op that only writes in place (cp::cache_write)
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for t in result if isinstance(t, torch.Tensor)]


def graph_time(fn: Callable[[], Any], iters: int = 20) -> dict[str, float]:
    """Capture `fn` in one CUDA graph and time `iters` replays one by one (CUDA events):
    median and spread in microseconds. Warm-up (Triton JIT) runs on a side stream first."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return {"us": statistics.median(times), "us_min": min(times), "us_max": max(times), "replays": iters}


def skipped_timing() -> dict[str, str]:
    return {"timing": "skipped: rehearsal on CPU (no CUDA graphs, CPU times mean nothing for the GPU)"}


def seeded(seed: int, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
