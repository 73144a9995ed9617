"""Quantised KV cache (issue 39): config, allocation, the quantising write, dequantise on load.

The torch reference (`ops/core/kv_quant.py`, the op bodies) is the oracle; the CPU kernels
(`ops/paged/cpu.py`, registered for the cpu key) must match it on the same cache bytes.
The Triton kernels are checked in test_quant_kv_kernels.py (interpreter), DCP on gloo ranks
in test_quant_kv_dcp.py.
"""

from __future__ import annotations

import pytest
import torch

import cp_compile
import cp_compile.ops  # noqa: F401
from cp_compile.ops.core import kv_quant
from cp_compile.ops.paged import cpu, cpu_decode, reference
from cp_compile.runtime.kv_cache import KVCacheSpec, allocate_kv_cache
from cp_compile.testing.batches import meta_args, two_step_metas

cp = torch.ops.cp
DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
BLOCK, NUM_BLOCKS = 4, 16


# ----------------------------------------------------------------------------- config and allocation


def test_config_refusals_name_field_value_and_fix():
    with pytest.raises(cp_compile.ConfigError, match=r"kv_cache_dtype='fp16'.*Fix: use 'auto'"):
        cp_compile.CPConfig(kv_cache_dtype="fp16")
    # Every feature takes a quantised cache now: DSA-CP since decision 69, MLAPO (its latent written
    # quantised) since decision 72 (tests/ops/test_sfa_quant_kv_dcp.py, tests/passes/test_mla_preprocess_model.py)
    cp_compile.CPConfig(kv_cache_dtype="int8", enable_dsa_cp=True, tensor_parallel_size=2)
    cp_compile.CPConfig(kv_cache_dtype="int8", enable_mla_preprocess=True)
    # PCP carries the scales since decision 68 (tests/cp_compile/test_pcp_exactness.py)
    cp_compile.CPConfig(kv_cache_dtype="int8", prefill_context_parallel_size=2, tensor_parallel_size=2)
    cfg = cp_compile.CPConfig(kv_cache_dtype="fp8_e4m3", tensor_parallel_size=2, decode_context_parallel_size=2)
    cfg.validate_for(cp_compile.AttentionSpec("sfa", 4, has_indexer=True))  # SFA since decision 69
    cfg.validate_for(cp_compile.AttentionSpec("mla", 4))
    cfg.validate_for(cp_compile.AttentionSpec("gqa", 4, 1))


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_allocate_counts_scale_bytes_and_shards_them(name):
    gqa = KVCacheSpec(num_layers=2, kind="gqa", head_dim=128, num_kv_heads_per_rank=2)
    mla = KVCacheSpec(num_layers=2, kind="mla", latent_dim=576)
    for spec, per_token_pages, per_token_scales in ((gqa, 2 * 2 * 128, 2 * 2), (mla, 576, 1)):
        base = allocate_kv_cache(cp_compile.CPConfig(block_size=BLOCK), spec, 8, dtype=torch.bfloat16, device="meta")
        q = allocate_kv_cache(cp_compile.CPConfig(block_size=BLOCK, kv_cache_dtype=name), spec, 8,
                              dtype=torch.bfloat16, device="meta")
        tokens = 8 * BLOCK
        assert base.sharded_bytes == 2 * tokens * per_token_pages * 2
        assert q.sharded_bytes == 2 * tokens * (per_token_pages * 1 + per_token_scales * 4)
        assert q.scale_bytes == 2 * tokens * per_token_scales * 4
        layer = q.layers[0]
        pages, scales = layer[:len(layer) // 2], layer[len(layer) // 2:]  # (k, v, k_scale, v_scale) / (kv, kv_scale)
        assert all(p.dtype == DTYPES[name] for p in pages) and all(s.dtype == torch.float32 for s in scales)
        assert all(s.shape == (8, BLOCK, 2 if spec.kind == "gqa" else 1) for s in scales)


# ----------------------------------------------------------------------------- the quantising write


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_write_quantises_per_token_and_head(name):
    dt = DTYPES[name]
    g = torch.Generator().manual_seed(0)
    new = torch.randn(6, 3, 16, generator=g) * torch.tensor([0.01, 1.0, 50.0])[None, :, None]  # heads of any range
    new[2] = 0.0  # an all-zero token: scale 1, codes 0
    cache = torch.zeros(4, BLOCK, 3, 16, dtype=dt)
    scales = torch.zeros(4, BLOCK, 3)
    slots = torch.tensor([5, -1, 7, 0, 15, 12])
    cp.quant_cache_write(new, cache, scales, slots)
    keep = slots >= 0
    flat, sflat = cache.view(-1, 3, 16), scales.view(-1, 3)
    got = kv_quant.dequantize(flat[slots[keep]], sflat[slots[keep]])
    want = new[keep]
    amax = want.abs().amax(-1, keepdim=True)
    # Per-row error bound of the format: int8 half a step of amax / 127; e4m3 2^-4 relative
    # (3 mantissa bits), plus the subnormal step at the bottom of the range.
    bound = amax / 127 / 2 if dt == torch.int8 else want.abs() / 16 + amax / 448 * 2.0 ** -9
    assert ((got - want).abs() <= bound + 1e-7).all()
    assert torch.equal(sflat[7], torch.ones(3))  # the zero token
    assert (flat.view(-1)[flat.float().view(-1) != 0].numel()) > 0
    assert torch.equal(cache.view(-1, 3, 16)[1].float(), torch.zeros(3, 16))  # slot 1 never written (token 1 skipped)
    # amax of every written row maps to qmax: the range is used in full
    assert torch.allclose(flat[slots[keep]].float().abs().amax(-1)[[0, 2, 3, 4]], torch.tensor(kv_quant.QMAX[dt]))


def test_pairing_is_refused_before_anything_is_written():
    """A quantised cache without its scales (or scales beside a bf16 cache) is refused, and
    neither cache is written (the check runs before the first write)."""
    metas = two_step_metas("decode", dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    m = metas[0]
    T = m.num_tokens
    kc = torch.zeros(NUM_BLOCKS, BLOCK, 1, 8, dtype=torch.int8)
    vc = torch.zeros(NUM_BLOCKS, BLOCK, 1, 8, dtype=torch.int8)
    ks = torch.zeros(NUM_BLOCKS, BLOCK, 1)
    x = torch.ones(T, 1, 8)
    with pytest.raises(ValueError, match="k_cache is torch.int8.*no scale cache.*pass the layer's scale cache"):
        cp.gqa_paged_attention(torch.ones(T, 2, 8), x, x, kc, vc, *meta_args(m), 0.3)  # the model-dtype op
    with pytest.raises(ValueError, match="v_cache is torch.float32 but a scale cache was passed"):
        cp.gqa_paged_attention_quant(torch.ones(T, 2, 8), x, x, kc, torch.zeros(NUM_BLOCKS, BLOCK, 1, 8), ks,
                                     torch.zeros_like(ks), *meta_args(m), 0.3)
    assert not kc.any() and not ks.any()  # refused before the first write
    with pytest.raises(ValueError, match="scale cache was passed: scales are for int8"):
        cp.quant_cache_write(x, torch.zeros(NUM_BLOCKS, BLOCK, 1, 8), ks, m.slot_mapping)
    with pytest.raises(ValueError, match=r"does not fit the quantised cache.*\[16, 4, 1\]"):
        cp.quant_cache_write(x, kc, torch.zeros(NUM_BLOCKS, BLOCK, 2), m.slot_mapping)


# ----------------------------------------------------------------------------- dequantise on load


def _gqa_case(dt, batch, seed=0):
    """Two steps (contexts, then `batch`) through one quantised GQA cache; returns step B's
    query, the cache pair and the metadata (Hq 4 over Hkv 2, D 16, Dv 8)."""
    g = torch.Generator().manual_seed(seed)
    caches = (torch.zeros(NUM_BLOCKS, BLOCK, 2, 16, dtype=dt), torch.zeros(NUM_BLOCKS, BLOCK, 2, 8, dtype=dt),
              torch.zeros(NUM_BLOCKS, BLOCK, 2), torch.zeros(NUM_BLOCKS, BLOCK, 2))
    metas = two_step_metas(batch, dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    for m in metas:
        T = m.num_tokens
        q, k, v = torch.randn(T, 4, 16, generator=g), torch.randn(T, 2, 16, generator=g), torch.randn(T, 2, 8, generator=g)
        out = cp.gqa_paged_attention_quant(q, k, v, *caches, *meta_args(m), 0.25)
    return q, caches, metas[1], out, (k, v)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("batch,kernel", [("mixed", "torch"), ("decode", "c"), ("mixed", "c")])
def test_cpu_kernel_matches_reference_on_the_same_bytes(name, batch, kernel, monkeypatch):
    """Both CPU paths: the C decode kernel (few query rows per KV head) and the torch flash
    path (CP_COMPILE_CPU_DECODE=torch), each dequantising on load."""
    monkeypatch.setenv("CP_COMPILE_CPU_DECODE", kernel)
    calls = []
    real = cpu_decode.attend
    monkeypatch.setattr(cpu_decode, "attend", lambda *a, **k: calls.append(r := real(*a, **k)) or r)
    dt = DTYPES[name]
    q, (kc, vc, ks, vs), m, out, _ = _gqa_case(dt, batch)
    from cp_compile.ops.core.layout import causal_lens
    kv_lens = causal_lens(m.query_start_loc, m.seq_lens, q.shape[0])
    want = reference.paged_attention_with_lse(q, kc, vc, m.block_table, m.query_start_loc, kv_lens, 0.25, ks, vs)
    got = cpu.paged_attention_lse(q, kc, vc, m.block_table, m.query_start_loc, kv_lens, 0.25, ks, vs)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)  # the op (cpu kernel) as well
    # The scales matter: reading the codes with the scales of another head moves the output.
    bad = cpu.paged_attention_lse(q, kc, vc, m.block_table, m.query_start_loc, kv_lens, 0.25, ks.flip(-1), vs)
    assert (bad[0] - want[0]).abs().max() > 1e-2
    assert any(c is not None for c in calls) == (kernel == "c")  # the path under test ran
    # MLA: one latent and its per-token scale, values = the first L columns.
    g = torch.Generator().manual_seed(1)
    lc, ls = torch.zeros(NUM_BLOCKS, BLOCK, 24, dtype=dt), torch.zeros(NUM_BLOCKS, BLOCK, 1)
    cp.quant_cache_write(torch.randn(m.num_tokens, 24, generator=g), lc, ls, m.slot_mapping)
    qn, qp = torch.randn(q.shape[0], 4, 16, generator=g), torch.randn(q.shape[0], 4, 8, generator=g)
    want = reference.mla_attention_with_lse(qn, qp, lc, m.block_table, m.query_start_loc, kv_lens, 0.3, ls)
    got = cpu.mla_attention_lse(qn, qp, lc, m.block_table, m.query_start_loc, kv_lens, 0.3, ls)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


def test_reference_dequantises_to_the_unquantised_attention():
    """The oracle itself: int8 attention over the dequantised rows equals fp32 attention over
    those same rows (the error is the rounding of the cache, nothing else)."""
    q, (kc, vc, ks, vs), m, out, _ = _gqa_case(torch.int8, "mixed")
    kf, vf = kv_quant.dequantize(kc, ks), kv_quant.dequantize(vc, vs)
    from cp_compile.ops.core.layout import causal_lens
    kv_lens = causal_lens(m.query_start_loc, m.seq_lens, q.shape[0])
    want = reference.paged_attention_with_lse(q, kf, vf, m.block_table, m.query_start_loc, kv_lens, 0.25)
    torch.testing.assert_close(out, want[0], atol=1e-5, rtol=1e-5)


def test_opcheck_with_scale_caches():
    q, (kc, vc, ks, vs), m, _, (k, v) = _gqa_case(torch.int8, "mixed")
    T = q.shape[0]
    from cp_compile.ops.core.layout import causal_lens
    kv_lens = causal_lens(m.query_start_loc, m.seq_lens, T)
    torch.library.opcheck(cp.paged_attention_lse, (q, kc, vc, m.block_table, m.query_start_loc, kv_lens, 0.25, ks, vs))
    # The writing ops on fresh caches: opcheck's schema test sees a mutation only where the
    # write changes a value (step B's rows are already in kc / ks).
    fresh = [torch.zeros_like(t) for t in (kc, vc, ks, vs)]
    torch.library.opcheck(cp.quant_cache_write, (k, fresh[0], fresh[2], m.slot_mapping))
    fresh = [torch.zeros_like(t) for t in (kc, vc, ks, vs)]
    torch.library.opcheck(cp.gqa_paged_attention_quant, (q, k, v, *fresh, *meta_args(m), 0.25))
    lc, ls = torch.zeros(NUM_BLOCKS, BLOCK, 24, dtype=torch.int8), torch.zeros(NUM_BLOCKS, BLOCK, 1)
    qn, qp, c, kp = torch.randn(T, 4, 16), torch.randn(T, 4, 8), torch.randn(T, 16), torch.randn(T, 8)
    torch.library.opcheck(cp.mla_attention_quant, (qn, qp, c, kp, lc, ls, *meta_args(m), 0.3))
    torch.library.opcheck(cp.mla_partial_attention, (qn, qp, lc, m.block_table, m.query_start_loc, kv_lens, 0.3, ls))
    # fp8: torch has no CPU comparison kernels for float8 (opcheck's schema test compares the
    # inputs before and after); the fake, autograd and AOT-dispatch tests run.
    f8 = torch.zeros(NUM_BLOCKS, BLOCK, 24, dtype=torch.float8_e4m3fn)
    torch.library.opcheck(cp.mla_attention_quant, (qn, qp, c, kp, f8, ls, *meta_args(m), 0.3),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_static_scale_write_stores_the_static_scale_and_clamps():
    """A checkpoint's static scale (decision 71): every written row gets that scale and its codes
    are `clamp(round(x / s))` (int8) / `clamp(x / s)` cast (fp8), through the op (CPU kernel and
    reference), opcheck'd with the optional static arguments."""
    q, (kc, vc, ks, vs), m, _, (k, v) = _gqa_case(torch.int8, "mixed")
    s_k, s_v = torch.tensor(0.01), torch.tensor(0.02)
    fresh = [torch.zeros_like(t) for t in (kc, vc, ks, vs)]
    out = cp.gqa_paged_attention_quant(q, k, v, *fresh, *meta_args(m), 0.25, k_static_scale=s_k,
                                       v_static_scale=s_v)
    keep = m.slot_mapping >= 0
    slots = m.slot_mapping[keep].long()
    for cache, scales, x, s in ((fresh[0], fresh[2], k, s_k), (fresh[1], fresh[3], v, s_v)):
        rows = cache.view(-1, *cache.shape[2:])[slots]  # [n, Hkv, D]
        assert torch.equal(scales.view(-1, scales.shape[-1])[slots], torch.full(rows.shape[:-1], s.item()))
        want = torch.round(x[: keep.shape[0]][keep].float() / s).clamp(-127, 127).to(torch.int8)
        assert torch.equal(rows, want)
        assert (rows.abs() == 127).any()  # the static scale clamps some rows here: not their amax scale
    ref = [torch.zeros_like(t) for t in (kc, vc, ks, vs)]
    want = reference.paged_attention_with_lse  # the attention over what was stored, read back by the reference
    kv_quant.write_quantized(ref[0], ref[2], k, m.slot_mapping, s_k)
    kv_quant.write_quantized(ref[1], ref[3], v, m.slot_mapping, s_v)
    from cp_compile.ops.core.layout import causal_lens
    kv_lens = causal_lens(m.query_start_loc, m.seq_lens, q.shape[0])
    torch.testing.assert_close(out, want(q, ref[0], ref[1], m.block_table, m.query_start_loc, kv_lens, 0.25,
                                         ref[2], ref[3])[0], atol=1e-5, rtol=1e-5)
    fresh = [torch.zeros_like(t) for t in (kc, vc, ks, vs)]
    torch.library.opcheck(cp.quant_cache_write, (k, fresh[0], fresh[2], m.slot_mapping, s_k))
    fresh = [torch.zeros_like(t) for t in (kc, vc, ks, vs)]
    torch.library.opcheck(cp.gqa_paged_attention_quant, (q, k, v, *fresh, *meta_args(m), 0.25, s_k, s_v))
    lc, ls = torch.zeros(NUM_BLOCKS, BLOCK, 24, dtype=torch.int8), torch.zeros(NUM_BLOCKS, BLOCK, 1)
    T = q.shape[0]
    qn, qp, c, kp = torch.randn(T, 4, 16), torch.randn(T, 4, 8), torch.randn(T, 16), torch.randn(T, 8)
    torch.library.opcheck(cp.mla_attention_quant, (qn, qp, c, kp, lc, ls, *meta_args(m), 0.3, s_k))
    cp.mla_attention_quant(qn, qp, c, kp, lc, ls, *meta_args(m), 0.3, kv_static_scale=s_k)  # one latent scale
    assert torch.equal(ls.view(-1)[slots], torch.full((slots.numel(),), s_k.item()))
    with pytest.raises(ValueError, match=r"k_static_scale \(2,\) torch.float32 is not one fp32 scale"):
        cp.gqa_paged_attention_quant(q, k, v, *fresh, *meta_args(m), 0.25, k_static_scale=torch.ones(2))
