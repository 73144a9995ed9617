"""The CPU attention-bandwidth benchmark (examples/bench/attention_bandwidth.py): every method
it times computes the same attention (a side timing different work would be a wrong figure),
and one small run writes the table's rows. No timing is asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cp_compile.ops.paged import cpu_decode
from examples.bench import attention_bandwidth as ab

ATTENTION = ("sdpa", "op in place", "op gathered", "torch in place", "torch gathered", "reference")


@pytest.mark.parametrize("context", [16, 208])  # one page; 13 pages
def test_every_method_times_the_same_attention(context: int) -> None:
    methods, kv_bytes = ab.decode_methods(context, batch=3, hq=8, hkv=2, d=32, bs=16, dtype=torch.float32,
                                          with_reference=True)
    assert kv_bytes == 2 * 3 * context * 2 * 32 * 4
    # In place: the reference's pages. Gathered: a shuffled table over the same cache (other
    # pages, so other values), the same for the C and the torch kernel.
    for name, against in (("sdpa", "reference"), ("op in place", "reference"), ("torch in place", "reference"),
                          ("op gathered", "torch gathered")):
        ref_out, ref_lse = methods[against]()  # [B, Hq, D], [B, Hq]
        out, lse = methods[name]()
        if name == "sdpa":  # [B, Hkv, g, D]: the GQA group's heads folded into rows, in head order
            out, lse = out.reshape(ref_out.shape), lse.reshape(ref_lse.shape)
        torch.testing.assert_close(out, ref_out, atol=2e-5, rtol=1e-5, msg=name)
        torch.testing.assert_close(lse, ref_lse, atol=2e-5, rtol=1e-5, msg=name)
    gathered, in_place = methods["op gathered"]()[0], methods["op in place"]()[0]
    assert not torch.allclose(gathered, in_place)  # the shuffle does reach other pages
    # The floor runs where the C kernel builds and the CPU has AVX2 + FMA, and only there.
    flags = set(open("/proc/cpuinfo").read().split()) if Path("/proc/cpuinfo").exists() else set()
    assert methods["fma floor"]() is (cpu_decode.library() is not None and {"avx2", "fma"} <= flags)


def test_small_run_writes_every_row(tmp_path: Path) -> None:
    ab.main(["--context", "64,96", "--batch", "2", "--rounds", "2", "--no-reference", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "attention_bandwidth.json").read_text())
    assert data["meta"]["rounds"] == 2 and data["prefill"] is None
    rows = data["decode"]
    by = {(r["op"], r["context"]): r for r in rows}
    want = {"sum", "fma floor", *ATTENTION} - {"reference"}
    assert {op for op, _ in by} == want and {c for _, c in by} == {64, 96}
    for (op, _), r in by.items():
        assert r["ms"]["min"] > 0 and r["ms"]["min"] <= r["ms"]["median"] <= r["ms"]["max"], (op, r["ms"])
        if op == "sdpa":
            assert r["x_sdpa"]["median"] == 1.0


def test_a_context_of_partial_pages_is_refused() -> None:
    with pytest.raises(ValueError, match="--context 200: .* multiple of --block-size 16"):
        ab.decode_methods(200, batch=1, hq=8, hkv=1, d=32, bs=16, dtype=torch.float32, with_reference=False)
