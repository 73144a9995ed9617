"""The fused MLA pre-processing family: `cp::mla_preprocess` (MLAPO).

`ops.py` (schema, fake, body, `OPS`), `reference.py` (torch oracle), `cpu.py` (CPU
kernel), `triton_tail.py` (Triton), `launch.py` (the op's device kernel), `npu.py`
(torch_npu's MLA prolog), `ge.py` (GE converter). Builds on the W8A8 linear of the
`quant` family.
"""
