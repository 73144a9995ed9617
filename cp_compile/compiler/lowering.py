"""Lowering of the rewritten graph: Inductor (CPU, CUDA), aot_eager, eager, torchair (NPU).

The torchair path is imported lazily. `reduce-overhead` (aclgraph capture and
replay, the default torchair mode) runs each op's registered NPU kernel (declared
with the op, registered at `import cp_compile.ops`: ops/core/registry.py). `max-autotune` (GE graph
mode) converts every FX node to GE operators: the `cp::*` converters live in
the op families' `ge*.py` (`cp_compile/ops/<family>/`) and are registered here; a `cp::*` op without one is a loud
error. Neither mode has run on an NPU. The FX -> GE conversion of the DCP graphs
is checked in CI on CPU (`python -m tools.ge_check`, docs/torchair.md),
with only torchair's C++ extension stood in.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Literal, Sequence

import torch
import torch.fx as fx

from cp_compile.base.errors import ConfigError
from cp_compile.ops.core.ge_registry import register_converters
from cp_compile.ops.core.scratch_block import has_scratch_block
from cp_compile.compiler.step_check import written_caches

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


def _import_torchair():
    """torch_npu (when it imports) then torchair. torchair itself decides whether it can
    work without torch_npu (its FX -> GE conversion can; running a graph cannot)."""
    try:
        import torch_npu  # noqa: F401  (must be imported before torchair)
    except ImportError:  # not installed, or the Ascend driver libraries are missing
        pass
    try:
        import torchair
    except ImportError as e:
        raise RuntimeError(
            "lowering='torchair' needs torch_npu (which ships torchair) and the Ascend driver libraries. "
            "Fix: `pip install cp-compile[ascend]` on an Ascend host, or use lowering='inductor' / 'aot_eager'"
        ) from e
    return torchair


def missing_ge_converters(gm: fx.GraphModule) -> list[str]:
    """`cp::*` ops in the graph that have no GE converter registered with torchair."""
    from torchair._ge_concrete_graph.fx2ge_converter import _get_converter  # type: ignore[import-not-found]

    ops = {n.target for n in gm.graph.nodes if n.op == "call_function" and str(n.target).startswith("cp.")}
    missing = []
    for op in ops:
        if isinstance(op, torch._ops.OpOverloadPacket):  # Dynamo graphs call the packet; converters are per overload
            op = op.default
        try:
            if _get_converter(op) is not None:
                continue
        except KeyError:
            pass
        missing.append(str(op))
    return sorted(missing)


def _refuse_caches_without_scratch(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """GE graphs write the tokens of slot -1 into each cache's scratch block (its last
    page; ops/paged/ge_cache.py, issue 21): a cache without one would have a page of real
    tokens overwritten. Checked once, at compile time, on the caches the graph writes."""
    for op, i in written_caches(gm):
        t = example_inputs[i] if i < len(example_inputs) else None
        if isinstance(t, torch.Tensor) and not isinstance(t, torch._subclasses.FakeTensor) \
                and t.device.type != "meta" and not has_scratch_block(t):
            raise ConfigError(
                "torchair max-autotune (GE graph mode) writes a cache only with a scratch block",
                f"graph input {i} (a cache {op} writes, shape {tuple(t.shape)}) has none, but the GE cache "
                "write sends every slot -1 (padding, another DCP rank's token) to the cache's last page "
                "(CANN's ScatterNdUpdate does not support out-of-range indices)",
                "allocate the caches with cp_compile.allocate_kv_cache(..., scratch_block=True) and keep "
                "BlockAllocator(num_blocks) (it never hands out the scratch block)")


def _refuse_fp8_caches(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """GE graph mode reads a quantised KV cache through FusedInferAttentionScore's int8 antiquant
    inputs; FIA takes no fp8 key / value (decision 70). Refused at compile time, before torchair
    converts anything, on the caches the graph writes (every quantised layer's pages are)."""
    for op, i in written_caches(gm):
        t = example_inputs[i] if i < len(example_inputs) else None
        if isinstance(t, torch.Tensor) and t.dtype == torch.float8_e4m3fn:
            raise ConfigError(
                "torchair max-autotune (GE graph mode) takes kv_cache_dtype 'auto' or 'int8'",
                f"graph input {i} (a cache {op} writes, shape {tuple(t.shape)}) is float8_e4m3fn "
                "(kv_cache_dtype='fp8_e4m3'), and CANN's FusedInferAttentionScore reads int8, fp16 or bf16 keys / "
                "values only",
                "use CPConfig(kv_cache_dtype='int8') on the NPU, or run the fp8 cache on CPU / CUDA (Triton)")


def _lower_torchair(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: TorchairMode) -> Callable[..., Any]:
    if mode not in ("reduce-overhead", "max-autotune"):
        raise ValueError(f"torchair mode {mode!r}: use 'reduce-overhead' or 'max-autotune'")
    torchair = _import_torchair()
    config = torchair.CompilerConfig()
    config.mode = mode
    if mode == "max-autotune":
        register_converters()  # GE converters for every cp:: op (cp_compile/ops/<family>/ge*.py)
        missing = missing_ge_converters(gm)
        if missing:
            raise RuntimeError(f"torchair max-autotune (GE graph) needs GE converters for {missing}. Fix: register "
                               f"one with torchair.register_fx_node_ge_converter (see cp_compile/ops/<family>/ge*.py), or use "
                               f"torchair_mode='reduce-overhead'")
        _refuse_caches_without_scratch(gm, example_inputs)
        _refuse_fp8_caches(gm, example_inputs)
        dump = os.environ.get("CP_COMPILE_GE_DUMP")  # GE graphs (original and optimised) as pbtxt
        if dump:
            config.debug.graph_dump.type = "pbtxt"
            config.debug.graph_dump.path = dump
    return torchair.get_npu_backend(compiler_config=config)(gm, list(example_inputs))
