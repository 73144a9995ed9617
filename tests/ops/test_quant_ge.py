"""The W8A8 linears through torchair's FX -> GE conversion (ops/quant/ge.py), on CPU with
only torchair's C++ extension stood in (docs/torchair.md): int8 x int8 -> int32 in
QuantBatchMatmulV3, per-group activation quantisation and fp32 dequantisation in GE
primitives, the model dtype in and out; and, evaluated on CPU, equal to the FX graph.
Reads the session's one check run (tests/ops/conftest.py)."""

from __future__ import annotations


def test_w8a8_linears_convert_to_ge(check) -> None:
    rc, data, output = check
    ops = {r["name"]: r for r in data.get("results", []) if "w8a8" in r["name"]}
    assert set(ops) == {"op:cp::w8a8_dynamic_linear", "op:cp::w8a8_static_linear"}, output
    for name, r in ops.items():
        assert r["status"] == "ok", (name, r["message"])
        assert r["ge_ops"]["QuantBatchMatmulV3"] == 1 and r["ge_ops"]["Round"] == 1, r["ge_ops"]
        assert r["io"]["outputs"] == ["input0: DT_BF16[6, 32]"], r["io"]
        assert r["io"]["inputs"][1] == "y: DT_INT8[64, 32]", r["io"]  # the K-major int8 weight, as given
        assert r["values"] and all(v["ok"] for v in r["values"]), r["values"]  # GE == FX by value
    assert ops["op:cp::w8a8_dynamic_linear"]["ge_ops"]["ReduceMaxD"] == 1  # the per-token amax
    assert "y: DT_INT32[2, 32]" in ops["op:cp::w8a8_static_linear"]["io"]["inputs"]  # the quant bias, per group
    assert data["summary"]["cp_ops_without_converter"] == []
