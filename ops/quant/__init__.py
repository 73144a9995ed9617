"""The W8A8 linear family: `cp::w8a8_dynamic_linear`, `cp::w8a8_static_linear`.

`ops.py` (schemas, fakes, bodies, `OPS`), `reference.py` (torch oracle),
`triton_int8_matmul.py` (Triton), `launch.py` (the ops' device kernels), `ge.py`
(GE converters).
"""
