"""Front door of the backend: entry point, decorator, lowering choices, loud errors."""

import importlib
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import cp_compile
from cp_compile.compiler.lowering import lower, resolve_lowering
from cp_compile.base.parallel_layout import Layout

backend_module = importlib.import_module("cp_compile.compiler.backend")  # the attribute cp_compile.backend is the factory


def test_entry_point_registers_backend_without_importing_cp_compile():
    code = ("import sys, torch; ok = 'cp_ascend' in torch._dynamo.list_backends(); "
            "print(ok, 'cp_compile' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "False"]


class Scaled(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.o_proj = torch.nn.Linear(4, 4)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.o_proj(input_ids.float()[:, None].expand(-1, 4)) + positions[:, None]


def test_decorator_compiles_records_roles_and_keeps_eager():
    Decorated = cp_compile.cp_module(o_proj="o_proj", lowering="aot_eager",
                                     dynamic_args=("input_ids", "positions"))(type("D", (Scaled,), {}))
    m = Decorated()
    (role,) = m.cp_roles
    assert (role.role, role.path, role.modules, role.parameters) == ("o_proj", "o_proj", ("o_proj",),
                                                                     ("o_proj.weight", "o_proj.bias"))
    for T in (5, 3, 7):  # token counts change: one graph
        ids, pos = torch.arange(T), torch.arange(T) * 2
        torch.testing.assert_close(m(ids, pos), m.cp_eager_forward(ids, pos))
    assert len(m.cp_compiled.backend.pass_managers) == 1


def test_decorator_rejects_unknown_roles_and_args():
    with pytest.raises(ValueError, match="role indexer='self_attn.indexer' names no submodule"):
        cp_compile.cp_module(indexer="self_attn.indexer")(type("A", (Scaled,), {}))()
    with pytest.raises(TypeError, match="dynamic_args \\['meta'\\] are not arguments of forward"):
        cp_compile.cp_module(type("B", (Scaled,), {}))()


def test_dcp_without_parallel_state_is_a_config_error():
    be = cp_compile.backend(config=cp_compile.CPConfig(tensor_parallel_size=2, decode_context_parallel_size=2))
    with pytest.raises(cp_compile.ConfigError, match="init_parallel"):
        be.make_pass_manager()


def _given_state(cfg: cp_compile.CPConfig, rank: int) -> SimpleNamespace:
    """What the backend reads of a parallel state (passes.context.RankGroups), built by
    hand: a layout with placeholder group names (no collective runs here)."""
    return SimpleNamespace(cfg=cfg, layout=Layout.for_test(cfg, rank), collective_costs=None)


def test_compile_path_reads_the_state_its_entry_gave_not_the_global(monkeypatch):
    # Issue 20: the parallel layout reaches the passes from the entry, as an argument.
    # With the module global unreadable, a backend holding a state still builds its
    # context, from that state's layout (a make_context that read the global would raise).
    def no_global():
        raise AssertionError("the compile path read the parallel-state global")

    cfg = cp_compile.CPConfig(tensor_parallel_size=4, decode_context_parallel_size=2)
    spec = cp_compile.AttentionSpec("gqa", 8, 2)
    state = _given_state(cfg, rank=3)
    be = cp_compile.backend(config=cfg, attention=spec, parallel=state)
    monkeypatch.setattr(cp_compile.runtime.parallel_state, "parallel_state_or_none", no_global)
    monkeypatch.setattr(backend_module, "parallel_state_or_none", no_global)
    monkeypatch.setattr(cp_compile.compiler.decorator, "parallel_state_or_none", no_global)
    for b in (be, be.for_batch_kind("decode")):
        ctx = b.make_context()
        assert ctx.layout is state.layout and (ctx.tp.rank, ctx.dcp.rank, ctx.cp.rank) == (3, 1, 1)
        assert ctx.cp_view().group is state.layout.cp and state.layout.cp.name == "test_dcp"
    # The decorator's entry binds the state it was given: nothing read at the first call.
    compiled = cp_compile.compile_model(Scaled(), dynamic_args=("input_ids", "positions"), config=cfg,
                                        attention=spec, parallel=state)
    compiled._setup()
    assert compiled.backend.parallel is state and compiled._cp_size == 2
    # A config the given state was not built for is refused, naming both.
    other = _given_state(cp_compile.CPConfig(tensor_parallel_size=4, decode_context_parallel_size=4), rank=0)
    with pytest.raises(cp_compile.ConfigError, match="backend config == init_parallel config"):
        cp_compile.backend(config=cfg, attention=spec, parallel=other).make_context()


def test_lowering_choices_and_errors():
    x = torch.randn(3)
    assert resolve_lowering("auto", [x]) == "inductor"
    gm = torch.fx.symbolic_trace(lambda t: t * 2)
    torch.testing.assert_close(lower(gm, [x], "eager")(x), x * 2)
    with pytest.raises(ValueError, match="unknown lowering"):
        lower(gm, [x], "tvm")
    # torch_npu cannot import here (no Ascend driver): the NPU path says what to do.
    with pytest.raises(RuntimeError, match=r"needs torch_npu .*`pip install cp-compile\[ascend\]`"):
        lower(gm, [x], "torchair")
