"""The LSE merge family: `cp::lse_rescale`, `cp::lse_combine`.

`ops.py` (schemas, fakes, bodies, `OPS`), `reference.py` (torch oracle),
`triton_merge.py` (Triton), `launch.py` (the ops' device kernels), `npu.py` (torch_npu
fused kernel), `ge.py` (GE converters).
"""
