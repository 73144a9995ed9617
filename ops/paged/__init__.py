"""The paged attention family: `cp::gqa_paged_attention`, `cp::mla_attention`,
`cp::cache_write`, `cp::dcp_localize_metadata`, `cp::paged_attention_lse`,
`cp::mla_partial_attention`.

`ops.py` (schemas, fakes, bodies, `OPS`), `reference.py` (torch oracle), `cpu.py` +
`cpu_decode.py` / `cpu_decode.c` (CPU kernels), `triton_decode.py` /
`triton_prefill.py` / `triton_localize.py` (Triton), `launch.py` (the ops' device
kernels), `npu.py` (torch_npu fused kernels), `ge.py` / `ge_cache.py` (GE converters).
"""
