"""Lowering of the rewritten graph: Inductor (CPU, CUDA), aot_eager, eager, torchair (NPU).

The torchair path is imported lazily and is UNTESTED here: torch_npu cannot be
imported without Ascend driver libraries, so no CI machine can run it. It follows
torchair's documented API (`torchair.CompilerConfig`, `config.mode`,
`torchair.get_npu_backend`, `torchair.patch_for_hcom`).

GE graph mode (`max-autotune`) converts every FX node to a GE operator; the
project's `cp::*` ops have no GE operator (they run Triton-Ascend kernels), so
they need converters registered with `torchair.register_fx_node_ge_converter`.
cp-compile ships none yet. The documented fallback is `reduce-overhead`
(aclgraph capture-and-replay), which runs each op's registered NPU kernel and
needs no converter; it is the default torchair mode here, and asking for
`max-autotune` with `cp::*` ops in the graph and no converters is a loud error.
"""

from __future__ import annotations

from typing import Any, Callable, Literal, Sequence

import torch
import torch.fx as fx

Lowering = Literal["auto", "inductor", "aot_eager", "eager", "torchair"]
TorchairMode = Literal["reduce-overhead", "max-autotune"]


def resolve_lowering(lowering: Lowering, example_inputs: Sequence[Any]) -> str:
    if lowering != "auto":
        return lowering
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    return "torchair" if "npu" in devices else "inductor"


def lower(gm: fx.GraphModule, example_inputs: Sequence[Any], lowering: Lowering = "auto",
          torchair_mode: TorchairMode = "reduce-overhead") -> Callable[..., Any]:
    kind = resolve_lowering(lowering, example_inputs)
    if kind == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, list(example_inputs))
    if kind == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, list(example_inputs))
    if kind == "eager":
        return gm.forward
    if kind == "torchair":
        return _lower_torchair(gm, example_inputs, torchair_mode)
    raise ValueError(f"unknown lowering {lowering!r}; use 'auto', 'inductor', 'aot_eager', 'eager' or 'torchair'")


def _lower_torchair(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: TorchairMode) -> Callable[..., Any]:
    try:
        import torch_npu  # noqa: F401  (must be imported before torchair)
        import torchair
    except ImportError as e:  # also raised when the Ascend driver libraries are missing
        raise RuntimeError(
            "lowering='torchair' needs torch_npu (which ships torchair) and the Ascend driver libraries. "
            "Fix: `pip install cp-compile[ascend]` on an Ascend host, or use lowering='inductor' / 'aot_eager'"
        ) from e
    if mode not in ("reduce-overhead", "max-autotune"):
        raise ValueError(f"torchair mode {mode!r}: use 'reduce-overhead' or 'max-autotune'")
    if mode == "max-autotune":
        cp_ops = sorted({str(n.target) for n in gm.graph.nodes
                         if n.op == "call_function" and str(n.target).startswith("cp.")})
        from torchair.ge_concrete_graph.fx2ge_converter import _get_converter  # type: ignore[import-not-found]

        missing = [name for name in cp_ops if _get_converter(eval(f"torch.ops.{name}")) is None]
        if missing:
            raise RuntimeError(f"torchair max-autotune (GE graph) needs GE converters for {missing}. Fix: use "
                               f"torchair_mode='reduce-overhead', or register converters with "
                               f"torchair.register_fx_node_ge_converter")
    torchair.patch_for_hcom()  # lets HCCL collectives enter the graph
    config = torchair.CompilerConfig()
    config.mode = mode
    return torchair.get_npu_backend(compiler_config=config)(gm, list(example_inputs))
