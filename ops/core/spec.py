"""How an op family declares its ops: one `OpDecl` per `cp::` op (docs/architecture.md §12).

An op lives in its family folder (`paged/`, `merge/`, `sparse/`, `quant/`,
`mla_preprocess/`, `pcp/`), in the family's op module (`ops.py`; the sparse family
also `dsa_cp.py`): the `torch.library.custom_op` (its schema), its `register_fake`
(the fake), its body (the torch reference: the CPU kernel and the tests' oracle,
built from the family's `reference.py`), and, at the end of the module, its
declaration in `OPS`:

    OpDecl(lse_combine,
           cuda=launch.lse_combine,           # Triton kernel adapter, same signature as the op
           npu=npu._lse_combine,              # torch_npu fused op, or TRITON_ASCEND, or Absent(why)
           ge=GE("ge", "AttentionUpdate"),    # merge/ge.py: convert_lse_combine; the GE ops it emits
           profile="dcp_local")               # benchmark profile bucket

A piece that does not exist is `Absent("why")`, never left out.
`core/catalog.py` collects every family's `OPS` and `core/registry.py` registers the
kernels at one moment (`import cp_compile.ops`); `tests/ops/test_op_catalog.py` walks every `cp::`
op and fails on a missing declaration, a piece without a reason, or a GE converter
not where its declaration says; the op table of docs/architecture.md §4 is
generated from the declarations (`python -m tools.op_table --write`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

# Where examples/bench/profile.py charges the op's time: attention work, DCP's own
# local work (localisation, merges, index remaps), or the rest of the step.
ProfileBucket = Literal["attention", "dcp_local", "other"]


@dataclass(frozen=True)
class Absent:
    """A piece of an op that does not exist, and why."""

    why: str

    def __post_init__(self) -> None:
        if not self.why.strip():
            raise ValueError("Absent(why=''): say why the piece does not exist")


@dataclass(frozen=True)
class TritonAscend:
    """The NPU kernel is the op's CUDA entry (a Triton kernel), compiled by triton-ascend."""


TRITON_ASCEND = TritonAscend()


@dataclass(frozen=True)
class Reference:
    """The CPU kernel is the op's body (the torch reference) itself."""


REFERENCE = Reference()


@dataclass(frozen=True, init=False)
class GE:
    """The op's torchair GE converter: `convert_<op name>` in the module `module` of the
    op's family folder (`cp_compile.ops.<family>.<module>`, `OpDecl.ge_module`;
    registered by `core/ge_registry.register_converters`), and the GE op types its
    converted graph contains (the GE check asserts them)."""

    module: str
    emits: tuple[str, ...]

    def __init__(self, module: str, *emits: str) -> None:
        if not emits:
            raise ValueError(f"GE({module!r}): name the GE op types the converter emits")
        object.__setattr__(self, "module", module)
        object.__setattr__(self, "emits", emits)

    @staticmethod
    def converter(op_name: str) -> str:
        """The converter function's name for 'cp::x': convert_x."""
        return "convert_" + op_name.split("::", 1)[1]


@dataclass(frozen=True)
class OpDecl:
    """Everything about one `cp::` op beyond its schema, fake and body (which sit above it).

    cuda: the CUDA kernel (a Triton launcher adapter with the op's signature) or Absent.
    npu:  the NPU eager / aclgraph kernel: a torch_npu fused-op adapter, TRITON_ASCEND
          (the cuda entry through triton-ascend) or Absent.
    ge:   the torchair GE converter (NPU graph mode, `max-autotune`) or Absent.
    profile: the benchmark bucket of the op's time.
    cpu:  the CPU kernel: REFERENCE (the body serves CPU too) or a faster torch
          implementation with the op's signature (`paged/cpu.py`); the body stays
          the oracle the tests compare it with (issue 26).
    An Absent kernel is registered as a refusal that names the op and the reason
    (`core/registry.MissingDeviceKernel`), never as a silent fallback to the reference.
    """

    op: Any  # the torch.library CustomOpDef (schema, fake and body)
    cuda: Callable[..., Any] | Absent
    npu: Callable[..., Any] | TritonAscend | Absent
    ge: GE | Absent
    profile: ProfileBucket
    cpu: Callable[..., Any] | Reference = REFERENCE

    @property
    def name(self) -> str:
        """'cp::op_name'."""
        return self.op._qualname

    @property
    def family(self) -> str:
        """The dotted package of the op's family folder ('cp_compile.ops.paged'): the
        package of the module that defines the op."""
        return self.op._init_fn.__module__.rsplit(".", 1)[0]

    @property
    def ge_module(self) -> str:
        """The dotted module holding the op's GE converter (its family folder's
        `GE.module`); raises ValueError for an op without one."""
        if not isinstance(self.ge, GE):
            raise ValueError(f"{self.name} has no GE converter: {self.ge}")
        return f"{self.family}.{self.ge.module}"
