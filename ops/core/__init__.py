"""Infrastructure shared by the op families, each piece written once (docs/architecture.md §2).

Below the families: `spec` (how a family declares an op: `OpDecl`), `layout` /
`pcp_layout` (DCP / PCP layout math), `sharded_cache` / `scratch_block` (cache
markers), `paged_cache` (reference access to a paged cache), `launcher` (lazy Triton
kernels), `triton_common` (Triton helpers, `LoweringDeclaration`), `attention_tile`
(the attention kernels' @triton.jit paged addressing, online softmax and epilogue),
`triton_cache_write` (the cache-write kernel two families launch), `npu` (torch_npu
access), `ge_util` / `ge_aten_pad` (GE helpers, the aten pad converter).

Above the families (they import every family): `catalog` (`FAMILIES`, `OPS`),
`registry` (device kernel registration), `ge_registry` (GE converter registration).

This package imports nothing itself, so a family can import a core module without
pulling in the catalog (which imports the families).
"""
