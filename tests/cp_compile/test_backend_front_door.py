"""Front door of the backend: entry point, decorator, lowering choices, loud errors."""

import subprocess
import sys

import pytest
import torch

import cp_compile
from cp_compile.lowering import lower, resolve_lowering


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
