"""STAND-IN for torchair's one C++ extension, `torchair.core._torchair` (CI check only).

torchair (shipped inside the torch-npu wheel under `torch_npu/dynamo/torchair`) is
pure Python above one C++ extension, `_torchair.so`, which links CANN's GE runtime
(`libge_runner.so`, `libgraph.so`, `libascendcl.so`, `libhccl.so`, ...). CANN is on
no registry this project can reach, so that extension cannot load here. This
module replaces *only* that extension, so that torchair's real Python code
(`get_npu_backend`, the FX -> GE converter registry, the generated op builders,
the GE graph passes, the pbtxt dumps) runs on CPU tensors. It is pinned to the
torchair inside `torch-npu==2.13.0` (TORCHAIR_VERSION below; `install()` refuses
another version) and is used by `python -m tools.ge_check` and nothing
else: never on an NPU, where the real extension loads.

What the stand-in does instead of the C++ code (each function below says so):
- the GE session: `InitializeGraphEngine` / `FinalizeGraphEngine` record the options;
- `TorchNpuGraphBase.load` parses the serialised GE graph (`ModelDef`) and keeps it
  in `LOADED` for the check to read; `compile` records the call; `run` raises
  `StandInCannotRun` (there is no GE runtime, no NPU);
- CANN's IR registry (`get_registered_ir_def`, used by `torchair.ge.custom_op`)
  answers SUCCESS only for the op types in `CANN_IR_TYPES` (the CANN ops our
  converters emit through `custom_op`, which torchair has no generated builder
  for) and ERROR for everything else, i.e. an op type CANN does not know;
- `check_cann_compat` (CANN op-version compatibility) answers "" (compatible) for
  every op: that check needs CANN's op library and is NOT done here.
Anything else raises `StandInUnsupported`, naming the function.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODULE = "torchair.core._torchair"
TORCH_NPU_VERSION = "2.13.0"  # .ci/constraints.txt pins torch-npu to this version
TORCHAIR_VERSION = "torch-npu 2.13.0"

# CANN op types our converters build with torchair.ge.custom_op (no generated builder
# exists in auto_generated_ge_raw_ops.py for these). Their IR is in CANN's opp
# (ops_transformer), which the stand-in cannot read: it only says "registered".
CANN_IR_TYPES = frozenset({"LightningIndexer", "SparseFlashAttention"})


class StandInCannotRun(RuntimeError):
    """Raised by `TorchNpuGraphBase.run`: the stand-in has no GE runtime."""


class StandInUnsupported(RuntimeError):
    """A `_torchair` function the stand-in does not provide."""


@dataclass
class LoadedGraph:
    name: str
    graph: Any  # the GE GraphDef proto (ModelDef.graph[0]) torchair serialised
    options: dict[str, str]
    input_placements: list[int]
    output_dtypes: list[int]
    executor_type: int
    compiled: bool = False


@dataclass
class _State:
    ge_options: dict[str, str] = field(default_factory=dict)
    graphs: list[LoadedGraph] = field(default_factory=list)
    ir_queries: list[str] = field(default_factory=list)


STATE = _State()


def _make_module() -> types.ModuleType:
    mod = types.ModuleType(MODULE)
    mod.__doc__ = "cp-compile STAND-IN for torchair.core._torchair (see tools.torchair_standin)"
    mod.CP_COMPILE_STANDIN = True

    def InitializeGraphEngine(options: dict) -> None:  # real: creates the GE session on the device
        STATE.ge_options.update({str(k): str(v) for k, v in dict(options).items()})

    def FinalizeGraphEngine() -> None:  # real: tears the GE session down
        return None

    def InitDeviceStdoutChannel(device_id: int) -> None:  # real: device printf channel
        return None

    def SetDebugLogPath(path: str) -> None:  # real: GE debug log file
        return None

    def StupidRepeat(word: str, times: int) -> str:  # real: a self-test of the extension
        return word * times

    def get_registered_ir_def(op_type: str):  # real: asks CANN's op IR registry
        STATE.ir_queries.append(op_type)
        if op_type in CANN_IR_TYPES:
            return "SUCCESS", [], [], []
        return "ERROR", [], [], []

    def check_cann_compat(op_type, runtime_optional_inputs, runtime_optional_attrs) -> str:
        return ""  # real: compares the op's optional inputs/attrs with the installed CANN; NOT checked here

    class TorchNpuGraphBase:  # real: GE graph load / compile / run on the NPU
        def __init__(self, name: str = "") -> None:
            self._name = str(name)
            self._loaded: LoadedGraph | None = None

        def load(self, serialized: bytes, options: dict, input_placements, output_dtypes, executor_type) -> None:
            from torchair.ge._ge_graph import ModelDef  # torchair's own GE IR proto

            model = ModelDef()
            model.ParseFromString(serialized)
            self._loaded = LoadedGraph(self._name, model.graph[0], {str(k): str(v) for k, v in dict(options).items()},
                                       list(input_placements), list(output_dtypes), int(executor_type))
            STATE.graphs.append(self._loaded)

        def set_hint_shape(self, inputs_shape, output_shapes) -> None:
            return None

        def compile(self) -> None:  # real: GE compile (op selection, fusion, memory planning)
            if self._loaded is not None:
                self._loaded.compiled = True

        def auto_tune(self, args) -> None:
            raise StandInUnsupported("torchair stand-in: AOE auto-tune needs CANN")

        def run(self, args) -> Any:
            raise StandInCannotRun(f"torchair stand-in: GE graph {self._name!r} was built and loaded; running it "
                                   "needs the GE runtime and an NPU")

    for fn in (InitializeGraphEngine, FinalizeGraphEngine, InitDeviceStdoutChannel, SetDebugLogPath, StupidRepeat,
               get_registered_ir_def, check_cann_compat):
        setattr(mod, fn.__name__, fn)
    mod.TorchNpuGraphBase = TorchNpuGraphBase

    class TorchDataType:  # real: a pybind enum used by torchair.llm_datadist (imported by torchair/__init__)
        def __getattr__(self, name: str) -> str:
            return name

    mod.TorchDataType = TorchDataType()

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def unsupported(*args: Any, **kwargs: Any) -> Any:
            raise StandInUnsupported(f"torchair stand-in: _torchair.{name} needs CANN (not provided by the stand-in)")

        return unsupported

    mod.__getattr__ = __getattr__
    return mod


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves the stand-in for exactly `torchair.core._torchair` and refuses `torch_npu`
    (ImportError, as on a machine without CANN); every other module (the rest of
    torchair included) is found and loaded as usual."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torch_npu" or fullname.startswith("torch_npu."):
            # torch_npu's package imports its C++ extension (CANN libraries) first thing;
            # torchair falls back when `import torch_npu` raises ImportError.
            raise ImportError("torch_npu is not imported under the torchair stand-in (needs CANN)")
        if fullname == MODULE:
            return importlib.machinery.ModuleSpec(fullname, self, origin="tools.torchair_standin")
        return None

    def create_module(self, spec):
        return _make_module()

    def exec_module(self, module):
        return None


def torchair_dir() -> Path | None:
    """`<site-packages>/torch_npu/dynamo` when the pinned torch-npu wheel is installed (not imported)."""
    spec = importlib.util.find_spec("torch_npu")
    if spec is None or not spec.submodule_search_locations:
        return None
    dynamo = Path(list(spec.submodule_search_locations)[0]) / "dynamo"
    return dynamo if (dynamo / "torchair" / "__init__.py").exists() else None


def install() -> types.ModuleType:
    """Put the stand-in in place and import torchair (without importing torch_npu's C++ parts).

    Raises RuntimeError when the pinned torch-npu is not installed. Idempotent.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        have = version("torch-npu")
    except PackageNotFoundError:
        have = None
    if have != TORCH_NPU_VERSION:
        raise RuntimeError(f"the torchair stand-in is pinned to torch-npu=={TORCH_NPU_VERSION} (found {have})")
    # torch_npu's torch device-backend autoload would import torch_npu (and fail without CANN).
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"
    dynamo = torchair_dir()
    if dynamo is None:
        raise RuntimeError("torch_npu/dynamo/torchair not found in the installed torch-npu wheel")
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    if str(dynamo) not in sys.path:
        sys.path.append(str(dynamo))
    import torchair

    if not getattr(sys.modules[MODULE], "CP_COMPILE_STANDIN", False):
        raise RuntimeError(f"{MODULE} is not the stand-in (the real extension was imported first)")
    return torchair


def installed() -> bool:
    mod = sys.modules.get(MODULE)
    return bool(getattr(mod, "CP_COMPILE_STANDIN", False))
