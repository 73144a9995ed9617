"""The torch_npu kernels of the quantised KV cache (ops/paged/npu.py, issue 39, decision 70), by value.

torch_npu cannot import here (it needs CANN). The kernels run against a STAND-IN `torch_npu`
(`ValueTorchNpu`, this file only; the scatter of tests/ops/test_npu_fused_kernels.py's
stand-in) whose `npu_fused_infer_attention_score` COMPUTES what torch_npu's page documents
for the arguments the kernels pass: paged BSND at S = 1, one batch row per token, and the
int8 antiquant modes 4 (per-token scales managed by page attention, (blocknum, blocksize))
and 5 (per token and head, (blocknum, N, blocksize)), key / value = code * scale (no offset:
symmetric). Anything else the stand-in is handed (another mode, a scale of another shape,
non-int8 pages with scales) fails the test. So these tests check the kernels' argument
mapping (which scale, transposed how, which mode) against the documented semantics, and the
write against the reference's bytes; they cannot check CANN itself.
"""

from __future__ import annotations

import sys

import pytest
import torch

from cp_compile.ops.core import kv_quant, layout, paged_cache
from cp_compile.ops.paged import npu as paged_npu
from cp_compile.ops.paged import reference
from cp_compile.testing.device_modes import HostReadMode
from tests.ops.test_npu_fused_kernels import FakeTorchNpu

MODES = {4: "per-token, (blocknum, blocksize)", 5: "per-token per-head, (blocknum, N, blocksize)"}


class ValueTorchNpu(FakeTorchNpu):
    """STAND-IN for torch_npu whose FIA computes the documented result (see the module doc)."""

    def npu_fused_infer_attention_score(self, q, k, v, **kw):
        self.calls.append(("npu_fused_infer_attention_score", kw))
        assert kw["input_layout"] == "BSND" and q.shape[1] == 1, "antiquant modes 4 / 5 are documented for Q_S = 1"
        T, _, H, D = q.shape
        Hkv, table, BS = kw["num_key_value_heads"], kw["block_table"], kw["block_size"]
        NB = k.shape[0]
        ks, vs = kw.get("key_antiquant_scale"), kw.get("value_antiquant_scale")
        kf, vf = k.float(), v.float()
        if ks is not None or vs is not None or k.dtype == torch.int8:
            mode = kw.get("key_antiquant_mode", 0)
            assert mode in MODES and kw.get("value_antiquant_mode", 0) == mode, kw
            assert k.dtype == v.dtype == torch.int8, "modes 4 / 5: int8 key / value only"
            want = (NB, BS) if mode == 4 else (NB, Hkv, BS)
            for s in (ks, vs):
                assert s.dtype == torch.float32 and tuple(s.shape) == want, (tuple(s.shape), want, MODES[mode])

            def dequant(c, s):
                rows = c.reshape(NB, BS, Hkv, -1).float()
                per = s[:, :, None] if mode == 4 else s.permute(0, 2, 1)  # [NB, BS, 1 | Hkv]
                return (rows * per[..., None]).reshape(NB, BS, -1)

            kf, vf = dequant(k, ks), dequant(v, vs)
        lens = kw["actual_seq_lengths_kv"]
        out = torch.zeros(T, 1, H, vf.shape[-1] // Hkv)
        lse = torch.full((T, H, 1, 1), float("inf"))  # +inf for a row without keys (one reading)
        g = H // Hkv
        for t in range(T):
            n = lens[t]
            if n == 0:
                continue
            nblk = -(-n // BS)
            rows_k = kf[table[t, :nblk].long()].reshape(nblk * BS, Hkv, -1)[:n]  # [n, Hkv, D]
            rows_v = vf[table[t, :nblk].long()].reshape(nblk * BS, Hkv, -1)[:n]
            s = torch.einsum("hd,nhd->hn", q[t, 0].float(), rows_k.repeat_interleave(g, dim=1)) * kw["scale"]
            l = torch.logsumexp(s, -1)  # [H]
            out[t, 0] = torch.einsum("hn,nhd->hd", torch.exp(s - l[:, None]), rows_v.repeat_interleave(g, dim=1))
            lse[t, :, 0, 0] = l
        return out.to(q.dtype), lse


@pytest.fixture
def npu(monkeypatch) -> ValueTorchNpu:
    fake = ValueTorchNpu()
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    return fake


def _quantised_case(gen: torch.Generator, rows: tuple[int, ...]):
    """A quantised paged cache [NB, BS, *rows] (int8 codes of random rows, their scales), a
    shuffled block table of 2 requests and 5 tokens (one with no key)."""
    NB, BS = 7, 4
    cache = torch.zeros(NB, BS, *rows, dtype=torch.int8)
    scale = torch.ones(NB, BS, rows[0] if len(rows) > 1 else 1)
    paged_cache.write_cache(cache, torch.randn(NB * BS, *rows, generator=gen), torch.arange(NB * BS), scale)
    table = torch.randperm(NB, generator=gen)[:6].reshape(2, 3).to(torch.int32)
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    kv_lens = torch.tensor([5, 0, 9, 10, 11], dtype=torch.int32)
    return cache, scale, table, qsl, kv_lens


def test_quantised_gqa_partial_through_fia_antiquant_equals_reference(npu: ValueTorchNpu) -> None:
    gen = torch.Generator().manual_seed(70)
    kc, ks, table, qsl, kv_lens = _quantised_case(gen, (2, 16))
    vc, vs, *_ = _quantised_case(gen, (2, 16))
    q = torch.randn(5, 8, 16, generator=gen).to(torch.bfloat16)
    out, lse = paged_npu._paged_attention_lse(q, kc, vc, table, qsl, kv_lens, 0.25, ks, vs)
    want_out, want_lse = reference.paged_attention_with_lse(q, kc, vc, table, qsl, kv_lens, 0.25, ks, vs)
    torch.testing.assert_close(out.float(), want_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    (_, kw), = npu.calls
    assert (kw["key_antiquant_mode"], kw["value_antiquant_mode"]) == (5, 5)
    assert torch.equal(kw["key_antiquant_scale"], ks.transpose(1, 2)), "mode 5 takes (blocknum, N, blocksize)"


def test_quantised_mla_partial_through_fia_antiquant_equals_reference(npu: ValueTorchNpu) -> None:
    gen = torch.Generator().manual_seed(71)
    c, s, table, qsl, kv_lens = _quantised_case(gen, (24,))
    qn, qp = torch.randn(5, 4, 16, generator=gen), torch.randn(5, 4, 8, generator=gen)
    out, lse = paged_npu._mla_partial_attention(qn, qp, c, table, qsl, kv_lens, 0.2, s)
    want_out, want_lse = reference.mla_attention_with_lse(qn, qp, c, table, qsl, kv_lens, 0.2, s)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    (_, kw), = npu.calls
    assert (kw["key_antiquant_mode"], kw["value_antiquant_mode"]) == (4, 4)


def test_quant_cache_write_on_npu_equals_reference_bytes(npu: ValueTorchNpu) -> None:
    gen = torch.Generator().manual_seed(72)
    cache, scale = torch.zeros(5, 4, 2, 16, dtype=torch.int8), torch.ones(5, 4, 2)
    new = torch.randn(7, 2, 16, generator=gen).to(torch.bfloat16)
    new[3] = 0  # an all-zero row: scale 1
    slots = torch.tensor([0, -1, 5, 17, 3, -1, 19])  # slot 0 taken: the -1 rows go elsewhere, then back
    want_c, want_s = cache.clone(), scale.clone()
    paged_cache.write_cache(want_c, new, slots, want_s)
    with HostReadMode():
        paged_npu._quant_cache_write(new, cache, scale, slots)
    npu.check_scatters()
    assert torch.equal(cache, want_c) and torch.equal(scale, want_s)


def test_single_device_quant_ops_on_npu_equal_reference(npu: ValueTorchNpu) -> None:
    from cp_compile.ops.paged.ops import gqa_paged_attention_quant, mla_attention_quant  # the op bodies (reference)

    gen = torch.Generator().manual_seed(73)
    qsl, seq = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([6, 9], dtype=torch.int32)
    table = torch.tensor([[3, 0, 5], [1, 6, 2]], dtype=torch.int32)
    pos = [4, 5, 6, 7, 8]
    slots = torch.tensor([int(table[r, p // 4]) * 4 + p % 4 for r, p in zip([0, 0, 1, 1, 1], pos)])
    caches = [torch.zeros(7, 4, 2, 16, dtype=torch.int8) for _ in range(2)] + [torch.ones(7, 4, 2) for _ in range(2)]
    paged_cache.write_cache(caches[0], torch.randn(28, 2, 16, generator=gen), torch.arange(28), caches[2])
    paged_cache.write_cache(caches[1], torch.randn(28, 2, 16, generator=gen), torch.arange(28), caches[3])
    q, k, v = (torch.randn(5, h, 16, generator=gen) for h in (8, 2, 2))
    mine = [c.clone() for c in caches]
    out = paged_npu._gqa_paged_attention_quant(q, k, v, *mine, slots, table, seq, qsl, 0.25)
    want = gqa_paged_attention_quant._init_fn(q, k, v, *caches, slots, table, seq, qsl, 0.25)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(mine, caches))  # codes byte-equal, scales equal
    lat, lat_s = torch.zeros(7, 4, 24, dtype=torch.int8), torch.ones(7, 4, 1)
    paged_cache.write_cache(lat, torch.randn(28, 24, generator=gen), torch.arange(28), lat_s)
    qn, qp, kv_c, k_pe = (torch.randn(*s, generator=gen) for s in ((5, 4, 16), (5, 4, 8), (5, 16), (5, 8)))
    mine = [lat.clone(), lat_s.clone()]
    out = paged_npu._mla_attention_quant(qn, qp, kv_c, k_pe, *mine, slots, table, seq, qsl, 0.2)
    want = mla_attention_quant._init_fn(qn, qp, kv_c, k_pe, lat, lat_s, slots, table, seq, qsl, 0.2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(mine[0], lat) and torch.equal(mine[1], lat_s)


def test_fp8_cache_refused_by_name_before_any_write(npu: ValueTorchNpu) -> None:
    fp8 = torch.float8_e4m3fn
    cache, scale = torch.zeros(3, 4, 2, 16, dtype=fp8), torch.ones(3, 4, 2)
    before = cache.view(torch.uint8).clone()
    with pytest.raises(NotImplementedError, match=r"cp::quant_cache_write: .*no fp8.*kv_cache_dtype='int8'"):
        paged_npu._quant_cache_write(torch.randn(2, 2, 16), cache, scale, torch.tensor([0, 1]))
    q = torch.randn(2, 4, 16)
    table, qsl, lens = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32), \
        torch.tensor([3, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=r"cp::paged_attention_lse: .*no fp8"):
        paged_npu._paged_attention_lse(q, cache, cache, table, qsl, lens, 0.25, scale, scale)
    assert npu.calls == [] and torch.equal(cache.view(torch.uint8), before)


def test_static_scale_refused_by_name_before_any_write(npu: ValueTorchNpu) -> None:
    """A checkpoint's static scale (decision 71) reaching the NPU kernels is refused by name, never
    replaced by dynamic scales without a word; nothing is written."""
    cache, scale = torch.zeros(3, 4, 2, 16, dtype=torch.int8), torch.ones(3, 4, 2)
    before = (cache.clone(), scale.clone())
    static = torch.tensor(0.01)
    with pytest.raises(NotImplementedError, match=r"cp::quant_cache_write: .*static per-layer scale.*Fix:"):
        paged_npu._quant_cache_write(torch.randn(2, 2, 16), cache, scale, torch.tensor([0, 1]), static)
    slots, table = torch.tensor([0, 1]), torch.tensor([[0, 1]], dtype=torch.int32)
    seq, qsl = torch.tensor([2], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    with pytest.raises(NotImplementedError, match=r"cp::gqa_paged_attention_quant: .*static"):
        paged_npu._gqa_paged_attention_quant(q, k, k, cache, cache.clone(), scale, scale.clone(), slots, table, seq,
                                             qsl, 0.25, static, None)
    lat, lat_s = torch.zeros(3, 4, 24, dtype=torch.int8), torch.ones(3, 4, 1)
    with pytest.raises(NotImplementedError, match=r"cp::mla_attention_quant: .*static"):
        paged_npu._mla_attention_quant(torch.randn(2, 4, 16), torch.randn(2, 4, 8), torch.randn(2, 16),
                                       torch.randn(2, 8), lat, lat_s, slots, table, seq, qsl, 0.2, static)
    assert npu.calls == [] and torch.equal(cache, before[0]) and torch.equal(scale, before[1])
    assert not lat.any() and torch.equal(lat_s, torch.ones(3, 4, 1))
