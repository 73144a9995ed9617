"""Run every GE graph torchair builds on CPU and compare it with its FX graph, by value.

`install()` patches two things in the check's process (never in the library):
- the stand-in's `TorchNpuGraphBase.run` (in place of GE's runtime) evaluates the
  loaded graph with `tools.ge_eval.evaluator` and writes ref outputs into the tensors
  torchair assigns, as GE does;
- `GeConcreteGraph.__call__`: before running the GE graph, runs the FX graph torchair
  converted (`_fx_graph`, the functionalised graph with the cp ops' CPU kernels) on
  clones of the same inputs, then the GE graph once per reading of the undocumented
  behaviours (`cann_ops.VARIANTS`) on fresh clones, and compares outputs and mutated
  inputs (the caches) with the tolerance of their dtype.

Each call appends a `Comparison` to `RESULTS`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from tools.ge_eval.cann_ops import fia_lse_variants
from tools.ge_eval.evaluator import Evaluator, Findings, GEEvalError

# (atol, rtol) per dtype: fp32 paths agree to 1e-5; bf16 / fp16 outputs to 2e-2 (a
# converter casting through fp32, the FX kernel rounding elsewhere: one ulp apart).
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2),
       torch.float16: (2e-2, 2e-2)}


@dataclass
class Comparison:
    graph: str  # the GE graph's name
    rows: list[dict[str, Any]] = field(default_factory=list)  # what, variant, dtype, max_abs_diff, ok
    error: str = ""  # the evaluator's refusal, if any
    uncertain: dict[str, int] = field(default_factory=dict)
    constraints: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error and all(r["ok"] for r in self.rows)

    def failures(self) -> list[str]:
        out = [self.error] if self.error else []
        return out + [f"{r['what']} [{r['variant']}] {r['dtype']} max abs diff {r['max_abs_diff']:.3g} ({r['why']})"
                      for r in self.rows if not r["ok"]]


RESULTS: list[Comparison] = []
# Set by the check around a graph whose GE path rounds through a lower precision than
# the FX kernel (the converter casts): that dtype's tolerance applies to every float.
TOLERANCE_DTYPE: torch.dtype | None = None
_STATE: dict[str, Any] = {"variant": {}, "findings": None, "comm": None}


def compare(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool, str]:
    """(max abs diff, within tolerance, why not): b is the FX (reference) value."""
    if a.shape != b.shape:
        return float("inf"), False, f"shape {tuple(a.shape)} vs FX {tuple(b.shape)}"
    if a.dtype != b.dtype:
        return float("inf"), False, f"dtype {a.dtype} vs FX {b.dtype}"
    if a.numel() == 0:
        return 0.0, True, ""
    if not (a.is_floating_point() or b.is_floating_point()):
        d = (a.long() - b.long()).abs()
        worst = float(d.max())
        return worst, worst == 0, "" if worst == 0 else "integers differ"
    af, bf = a.double(), b.double()
    fin_a, fin_b = torch.isfinite(af), torch.isfinite(bf)
    same_special = torch.where(fin_a | fin_b, fin_a == fin_b, (af == bf) | (torch.isnan(af) & torch.isnan(bf)))
    if not bool(same_special.all()):
        bad = int((~same_special).sum())
        return float("inf"), False, f"{bad} non-finite values differ (e.g. -inf vs NaN / a number)"
    both = fin_a & fin_b
    diff = (af - bf).abs()[both]
    worst = float(diff.max()) if diff.numel() else 0.0
    atol, rtol = TOL.get(TOLERANCE_DTYPE or a.dtype, (0.0, 0.0))
    ok = bool((diff <= atol + rtol * bf.abs()[both]).all())
    return worst, ok, "" if ok else f"beyond atol {atol} + rtol {rtol}"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN == NaN (a scratch block poisoned by an earlier step is unchanged)."""
    return a.shape == b.shape and bool(torch.equal(a, b) or (a.isnan() & b.isnan() | (a == b)).all()) \
        if a.is_floating_point() else torch.equal(a, b)


def _clone(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _flat(out) -> list:
    if isinstance(out, (list, tuple)):
        return [x for o in out for x in _flat(o)]
    return [out]


def _cpu_kernels_for_torchair_decompositions() -> None:
    """torchair decomposes all_to_all_single into its own `npu_define::all_to_all_single_npu`
    with an eager kernel for the NPU only; the FX graph runs on CPU, so the same torchair
    function is registered for CPU too (it calls torch.distributed on the gloo group)."""
    from torchair._ge_concrete_graph.ge_converter.experimental import hcom_alltoall
    from torchair._ge_concrete_graph.ge_converter.experimental.hcom_allreduce import npu_define_lib

    fn = getattr(hcom_alltoall, "npu_all_to_all_single_npu", None)
    if fn is not None:
        npu_define_lib.impl("all_to_all_single_npu", fn, "CPU")


def install(comm=None) -> None:
    """Patch the stand-in's run and torchair's graph call (idempotent)."""
    from torchair._ge_concrete_graph.fx2ge_converter import GeConcreteGraph

    _STATE["comm"] = comm
    if getattr(GeConcreteGraph, "_cp_value_probe", False):
        return
    _cpu_kernels_for_torchair_decompositions()
    base = sys.modules["torchair.core._torchair"].TorchNpuGraphBase

    def run(self, args):
        inputs, assigned, _stream = args
        if self._loaded is None:
            raise GEEvalError("run before load")
        outs = Evaluator(self._loaded.graph, comm=_STATE["comm"], findings=_STATE["findings"],
                         variant=_STATE["variant"]).run(list(inputs))
        outs = list(outs)
        for i, t in enumerate(assigned or []):
            if t is not None:
                t.copy_(outs[i])
                outs[i] = t
        return outs

    base.run = run
    original = GeConcreteGraph.__call__

    def call(self, *args, **kwargs):
        from cp_compile.ops.core.scratch_block import has_scratch_block

        result = Comparison(graph=str(self.graph.name))
        RESULTS.append(result)
        before = _clone(args)
        fx_args = _clone(args)
        with torch.no_grad():
            fx_out = _flat(self._fx_graph(*fx_args))
        variants = fia_lse_variants()
        ge_out = None
        findings = Findings()
        for k, variant in enumerate(variants):
            last = k == len(variants) - 1
            ge_args = list(args) if last else _clone(args)
            _STATE["variant"], _STATE["findings"] = variant, findings
            label = ",".join(f"{key}={val}" for key, val in variant.items())
            try:
                out = original(self, *ge_args, **kwargs)
            except GEEvalError as e:
                result.error = str(e)
                break
            flat = _flat(out)
            if len(flat) != len(fx_out):
                result.error = f"GE graph returned {len(flat)} outputs, the FX graph {len(fx_out)}"
                break
            for i, (g, f) in enumerate(zip(flat, fx_out)):
                if isinstance(g, torch.Tensor) and isinstance(f, torch.Tensor):
                    d, ok, why = compare(g, f)
                    result.rows.append(dict(what=f"output {i}", variant=label, dtype=str(g.dtype).replace("torch.", ""),
                                            max_abs_diff=d, ok=ok, why=why))
            for i, (g, f, b) in enumerate(zip(ge_args, fx_args, before)):
                if isinstance(g, torch.Tensor) and isinstance(f, torch.Tensor) and f.dtype == g.dtype \
                        and (not _same(f, b) or not _same(g, b)):
                    # A cache's scratch block (its last page) holds what the GE writes of
                    # slot -1 put there and the FX kernels skip: undefined, read by nothing.
                    pages = slice(None, -1) if has_scratch_block(args[i]) else slice(None)
                    d, ok, why = compare(g[pages], f[pages])
                    what = f"input {i} (mutated{', scratch block not compared' if pages.stop else ''})"
                    result.rows.append(dict(what=what, variant=label, dtype=str(g.dtype).replace("torch.", ""),
                                            max_abs_diff=d, ok=ok, why=why))
            ge_out = out
        result.uncertain = dict(findings.uncertain)
        result.constraints = dict(findings.constraints)
        _STATE["variant"], _STATE["findings"] = {}, None
        if ge_out is None:  # refused: let the caller see the FX values, the comparison says why
            return tuple(fx_out)
        return ge_out

    GeConcreteGraph.__call__ = call
    GeConcreteGraph._cp_value_probe = True
