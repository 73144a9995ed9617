"""CI tools for the torchair GE graph check (not part of the installed library).

`evaluator` executes a serialised GE graph (the ModelDef torchair hands to GE's
`load`) with torch on CPU: the primitive op types our converters and torchair's
aten converters emit, the CANN fused ops (`cann_ops`, written from CANN's public
operator documentation, docs/torchair.md lists the pages) and the HCCL ops
(`hccl`, over the gloo process groups of the same world). It is a reference
runtime for the value check, not a GE: it compiles nothing and knows no NPU.
"""
