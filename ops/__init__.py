"""Custom ops of cp-compile (installed as `cp_compile.ops`).

Importing this package registers every `cp::*` op with torch.library. The ops are
grouped by family, one folder each holding everything about its ops (declarations,
torch reference, CPU kernel, Triton kernels, launch adapters, NPU fused kernels, GE
converters): `paged` (paged attention, cache writes, DCP localisation and partial
attention), `merge` (the LSE merges), `sparse` (the DSA lightning indexer and sparse
MLA, their SFA DCP and DSA-CP blocks), `quant` (the W8A8 linears), `mla_preprocess`
(the fused MLA pre-processing), `pcp` (PCP's token-index marker). Infrastructure
they share is written once in `core` (the declaration types, the catalog, the kernel
registration, layout math, Triton and GE helpers). `core.catalog` collects every
family's `OPS`; the kernels are registered here, once. The parallel compositions
built from these ops live in `cp_compile.ops.parallel`; the graph rewrites that
place them, in `cp_compile.passes`.

Imported as anything but `cp_compile.ops` (`import ops` from the repository root)
it refuses to load, rather than register every op a second time.
"""

if __name__ != "cp_compile.ops":  # e.g. `import ops` with the repository root on sys.path
    raise ImportError(
        f"{__name__!r}: the ops/ folder is the package `cp_compile.ops`; imported under another name it "
        f"would be a second copy that registers every cp:: op a second time. Fix: `import cp_compile.ops` "
        f"(`from cp_compile.ops import ...`)")

from cp_compile.ops.core.registry import register_device_kernels  # imports the catalog, which imports every family

register_device_kernels()
