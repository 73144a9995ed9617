"""Custom ops of cp-compile (installed as `cp_compile.ops`).

Importing this package registers every `cp::*` op with torch.library:
single-device attention ops (`attention`), the DCP building blocks (`dcp`) and the
DSA-CP token-shard blocks (`dsa_cp`), the W8A8 linears (`quant`), the fused MLA
pre-processing (`mla_preprocess`), PCP's token-index marker (`pcp`), with
their torch references (`reference`), layout math (`layout`) and kernels
(`kernels`). Each family module declares every piece of its ops (`OPS`,
`spec.OpDecl`); `catalog` collects them and the kernels are registered here, once.
The parallel compositions built from these ops live in
`cp_compile.ops.parallel`; the graph rewrites that place them, in `cp_compile.passes`.

Imported as anything but `cp_compile.ops` (`import ops` from the repository root)
it refuses to load, rather than register every op a second time.
"""

if __name__ != "cp_compile.ops":  # e.g. `import ops` with the repository root on sys.path
    raise ImportError(
        f"{__name__!r}: the ops/ folder is the package `cp_compile.ops`; imported under another name it "
        f"would be a second copy that registers every cp:: op a second time. Fix: `import cp_compile.ops` "
        f"(`from cp_compile.ops import ...`)")

from cp_compile.ops import attention, dcp, dsa_cp, layout, mla_preprocess, pcp, quant, reference  # noqa: F401
from cp_compile.ops.kernels.registry import register_device_kernels

register_device_kernels()
