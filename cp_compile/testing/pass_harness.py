"""Graph-structure tests of the pass pipeline in one process (the idea of vLLM's TestBackend).

`capture_graph` traces a function with Dynamo exactly as the cp_ascend backend would
receive it (fake values on every node, symbolic token dims) and runs it once,
unmodified, on one device. `run_pipeline` then runs the pipeline that a
`CompileContext` enables on that graph and returns the pass manager, whose history
holds the op histogram before and after every pass. A context from
`CompileContext.for_test` names process groups that do not exist, so the rewritten
graph is inspected, never run: numerics stay on real gloo ranks
(`cp_compile.testing.multirank`).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx

from cp_compile.passes.context import CompileContext
from cp_compile.passes.pass_manager import PassManager


def capture_graph(fn: Callable[..., Any], *args: Any, dynamic: bool = True) -> fx.GraphModule:
    """The Dynamo graph of `fn(*args)` (fullgraph), after running it once unmodified."""
    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        graphs.append(gm)
        return gm.forward

    # Every capture of the same forward (new module, new context) would count as a
    # recompile of one code object; start from clean Dynamo caches instead. Test-only:
    # this drops every compiled function of the process.
    torch._dynamo.reset()
    torch.compile(fn, backend=keep, fullgraph=True, dynamic=dynamic)(*args)
    if len(graphs) != 1:
        raise RuntimeError(f"expected one graph, Dynamo produced {len(graphs)}")
    return graphs[0]


def run_pipeline(fn: Callable[..., Any], args: tuple[Any, ...], ctx: CompileContext) -> tuple[PassManager,
                                                                                             fx.GraphModule]:
    """Capture `fn(*args)` and run the pipeline `ctx` enables on it, in this process."""
    gm = capture_graph(fn, *args)
    pm = PassManager.for_context(ctx)
    pm(gm)
    return pm, gm
