"""Triton kernels of the quantised KV cache (issue 39) against the torch oracle, under the
interpreter: the quantising cache write (the same bytes and scales as `kv_quant.write_quantized`)
and the decode and query-tiled prefill kernels' dequantise on load (GQA and MLA, split and
unsplit; prefill tiles over pages that end mid-tile, one-token contexts, empty DCP shards); the
sparse MLA (SFA) kernel's dequantise on load (split-KV and its merge, unsplit, tl.dot and
broadcast products).

TRITON_INTERPRET is read when triton is first imported (see test_kernels.py): run alone this
file sets it and checks in-process; otherwise one test reruns the file in a fresh interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

_CHILD_ENV = "CP_COMPILE_QUANT_KERNEL_TESTS_CHILD"
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

import cp_compile.ops  # noqa: E402,F401
from cp_compile.ops.core import layout  # noqa: E402
from cp_compile.ops.core.launcher import triton_available  # noqa: E402
from cp_compile.ops.paged import reference  # noqa: E402
from cp_compile.testing.batches import meta_args, two_step_metas  # noqa: E402

assert triton_available(), "triton is not installed: pip install -e '.[test]'"

from cp_compile.ops.core.triton_cache_write import cache_write_device  # noqa: E402
from cp_compile.ops.core.triton_common import capture_launches, interpreter_active  # noqa: E402
from cp_compile.ops.paged import launch  # noqa: E402
from cp_compile.ops.paged.triton_decode import paged_attention_with_lse_triton  # noqa: E402
from cp_compile.ops.core import kv_quant  # noqa: E402
from cp_compile.ops.sparse import launch as sparse_launch  # noqa: E402
from cp_compile.ops.sparse import reference as sparse_reference  # noqa: E402
from cp_compile.ops.sparse.triton_sparse_mla import sparse_mla_rows_triton  # noqa: E402
from cp_compile.ops.paged.triton_prefill import paged_prefill_attention_lse_triton  # noqa: E402

IN_PROCESS = interpreter_active()
interp = pytest.mark.skipif(not IN_PROCESS, reason="triton imported without TRITON_INTERPRET=1: "
                            "covered by test_quant_kernels_in_fresh_interpreter")
DTYPES = [torch.int8, torch.float8_e4m3fn]
BLOCK, NUM_BLOCKS = 4, 16
PREFILL_BLOCKS = 32


@interp
@pytest.mark.parametrize("dt", DTYPES, ids=["int8", "fp8"])
@pytest.mark.parametrize("row", [(2, 16), (24,)], ids=["gqa", "mla"])
def test_triton_cache_write_quantises_like_the_oracle(dt, row):
    g = torch.Generator().manual_seed(0)
    new = torch.randn(7, *row, generator=g) * 3
    new[3] = 0.0  # all-zero row: scale 1
    new[0, ..., :4] = torch.tensor([0.5, -0.5, 1.5, 2.5]) * new[0].abs().amax() / 127  # int8 ties (half to even)
    slots = torch.tensor([5, -1, 7, 0, 31, 12, -1])
    heads = row[0] if len(row) == 2 else 1
    want_c, got_c = torch.zeros(8, BLOCK, *row, dtype=dt), torch.zeros(8, BLOCK, *row, dtype=dt)
    want_s, got_s = torch.zeros(8, BLOCK, heads), torch.zeros(8, BLOCK, heads)
    torch.ops.cp.quant_cache_write(new, want_c, want_s, slots)  # the CPU op: the torch oracle
    cache_write_device(new, got_c, slots, got_s)
    torch.testing.assert_close(got_s, want_s, atol=0, rtol=1e-6)
    # codes: integers on a grid; a scale within 1 ulp would move a code by at most one step
    assert torch.equal(got_c.view(torch.uint8), want_c.view(torch.uint8))


@interp
@pytest.mark.parametrize("dt, splits", [(torch.int8, None), (torch.float8_e4m3fn, 1)], ids=["int8-split", "fp8-unsplit"])
def test_triton_decode_dequantises_on_load(dt, splits):
    g = torch.Generator().manual_seed(1)
    metas = two_step_metas("mixed", dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    kc, vc = torch.zeros(NUM_BLOCKS, BLOCK, 2, 16, dtype=dt), torch.zeros(NUM_BLOCKS, BLOCK, 2, 8, dtype=dt)
    ks, vs = torch.zeros(NUM_BLOCKS, BLOCK, 2), torch.zeros(NUM_BLOCKS, BLOCK, 2)
    lc, ls = torch.zeros(NUM_BLOCKS, BLOCK, 24, dtype=dt), torch.zeros(NUM_BLOCKS, BLOCK, 1)
    for m in metas:
        T = m.num_tokens
        torch.ops.cp.quant_cache_write(torch.randn(T, 2, 16, generator=g), kc, ks, m.slot_mapping)
        torch.ops.cp.quant_cache_write(torch.randn(T, 2, 8, generator=g), vc, vs, m.slot_mapping)
        torch.ops.cp.quant_cache_write(torch.randn(T, 24, generator=g), lc, ls, m.slot_mapping)
    m = metas[1]
    T = m.num_tokens
    kv_lens = layout.causal_lens(m.query_start_loc, m.seq_lens, T)
    q = torch.randn(T, 4, 16, generator=g)
    want = reference.paged_attention_with_lse(q, kc, vc, m.block_table, m.query_start_loc, kv_lens, 0.25, ks, vs)
    got = paged_attention_with_lse_triton(q, kc, vc, m.block_table, m.query_start_loc, kv_lens, 0.25,
                                          num_splits=splits, k_scale_cache=ks, v_scale_cache=vs)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    # MLA through the registered launcher (latent + rope, one scale per token)
    qn, qp = torch.randn(T, 4, 16, generator=g), torch.randn(T, 4, 8, generator=g)
    want = reference.mla_attention_with_lse(qn, qp, lc, m.block_table, m.query_start_loc, kv_lens, 0.3, ls)
    got = launch.mla_partial_attention(qn, qp, lc, m.block_table, m.query_start_loc, kv_lens, 0.3, ls)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)


def _prefill_batch(g: torch.Generator):
    """4 requests (1 .. 9 new tokens over 0 .. 13 cached: a one-token context, pages of 4 that
    end mid-tile) and 2 padding tokens, over a shuffled block table."""
    lens, ctx = [1, 9, 3, 6], [0, 13, 5, 2]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([a + b for a, b in zip(lens, ctx)], dtype=torch.int32)
    bt = torch.randperm(PREFILL_BLOCKS, generator=g)[:24].view(4, 6).to(torch.int32)
    return qsl, seq, bt, int(qsl[-1]) + 2


def _quant_pages(g: torch.Generator, dt: torch.dtype, *row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every slot of a cache written through cp::quant_cache_write (codes + per-row scales)."""
    cache = torch.zeros(PREFILL_BLOCKS, BLOCK, *row, dtype=dt)
    scales = torch.zeros(PREFILL_BLOCKS, BLOCK, row[0] if len(row) == 2 else 1)
    n = PREFILL_BLOCKS * BLOCK
    torch.ops.cp.quant_cache_write(torch.randn(n, *row, generator=g) * torch.rand(n, *row[:-1], 1, generator=g) * 4,
                                   cache, scales, torch.arange(n))
    return cache, scales


@interp
@pytest.mark.parametrize("dt", DTYPES, ids=["int8", "fp8"])
def test_triton_prefill_dequantises_on_load(dt):
    """The query-tiled kernel over quantised pages == the reference, on one device (causal
    lens) and on rank 1 of a dcp 2 shard (local lens: it holds no key of the one-token
    request, an empty shard); GQA group 2 with padded head dims (D 24, Dv 20), MLA latent +
    rope through the registered launcher, which routes T >= 4 B to this kernel. fp32 q: the
    interpreter's tl.dot misreads bf16 (docs/kernels.md); bf16 runs in the GPU check."""
    g = torch.Generator().manual_seed(3)
    qsl, seq, bt, T = _prefill_batch(g)
    kc, ks = _quant_pages(g, dt, 2, 24)
    vc, vs = _quant_pages(g, dt, 2, 20)
    lc, ls = _quant_pages(g, dt, 40)
    tol = dict(atol=1e-5, rtol=1e-5)
    q = torch.randn(T, 4, 24, generator=g)
    qn, qp = torch.randn(T, 4, 32, generator=g), torch.randn(T, 4, 8, generator=g)
    views = [layout.causal_lens(qsl, seq, T), layout.local_causal_lens(qsl, seq, T, cp=2, rank=1, interleave=1)]
    assert views[1][0] == 0 and views[0].max() > 16  # an empty shard row; more keys than one tile
    for kv_lens in views:
        want = reference.paged_attention_with_lse(q, kc, vc, bt, qsl, kv_lens, 0.25, ks, vs)
        got = paged_prefill_attention_lse_triton(q, kc, vc, bt, qsl, kv_lens, 0.25, block_m=16, block_n=16,
                                                 num_programs=3, k_scale_cache=ks, v_scale_cache=vs)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
        want = reference.mla_attention_with_lse(qn, qp, lc, bt, qsl, kv_lens, 0.3, ls)
        got = launch.mla_partial_attention(qn, qp, lc, bt, qsl, kv_lens, 0.3, ls)
        torch.testing.assert_close(got[0], want[0], **tol)
        torch.testing.assert_close(got[1], want[1], **tol)
    # the routing: this batch (T >= 4 B) takes the quantised prefill kernel, one token a request the decode kernel
    with capture_launches() as launches:
        launch.paged_attention_lse(q, kc, vc, bt, qsl, views[0], 0.25, ks, vs)
        launch.paged_attention_lse(q[:4], kc, vc, bt, torch.arange(5, dtype=torch.int32), views[0][:4], 0.25, ks, vs)
    assert [lc.kernel.fn.__name__ for lc in launches][:2] == ["_paged_prefill_quant_kernel",
                                                              "_paged_attention_lse_kernel"]


@interp
def test_triton_single_device_ops_on_a_quantised_cache():
    """The launch adapters of the single-device ops (cache write + attention) on int8."""
    g = torch.Generator().manual_seed(2)
    m = two_step_metas("decode", dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)[0]
    T = m.num_tokens
    q, k, v = torch.randn(T, 4, 16, generator=g), torch.randn(T, 2, 16, generator=g), torch.randn(T, 2, 16, generator=g)
    caches = [torch.zeros(NUM_BLOCKS, BLOCK, 2, 16, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(NUM_BLOCKS, BLOCK, 2) for _ in range(2)]
    want_c = [c.clone() for c in caches]
    want_s = [s.clone() for s in scales]
    got = launch.gqa_paged_attention_quant(q, k, v, *caches, *scales, *meta_args(m), 0.25)
    want = torch.ops.cp.gqa_paged_attention_quant(q, k, v, *want_c, *want_s, *meta_args(m), 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(caches + scales, want_c + want_s))


def _sparse_case(dt: torch.dtype, seed: int):
    """A quantised latent [NB, 4, 40+12] (codes written by the quantising write, so every page a
    request owns holds real codes and scales; other pages' scales NaN: a read of one poisons its
    row), three requests' index lists of 12 / 7 / 0 entries (-1 gaps and tails), a padding row."""
    g = torch.Generator().manual_seed(seed)
    NB, L, R, H = 12, 40, 12, 4
    codes = torch.zeros(NB, BLOCK, L + R, dtype=dt)
    scales = torch.full((NB, BLOCK, 1), float("nan"))
    bt = (torch.randperm(NB - 1, generator=g)[:9] + 1).view(3, 3).to(torch.int32)
    slots = (bt.long()[:, :, None] * BLOCK + torch.arange(BLOCK)).flatten()  # every slot of the table
    torch.ops.cp.quant_cache_write(torch.randn(slots.numel(), L + R, generator=g) * 4, codes, scales, slots)
    codes[0], scales[0] = codes[int(bt[0, 0])], scales[int(bt[0, 0])]  # page 0: skipped entries read it
    idx = torch.full((4, 12), -1, dtype=torch.int32)
    for b, n in enumerate((12, 7, 0)):
        idx[b, :n] = torch.randperm(3 * BLOCK, generator=g)[:n].to(torch.int32)
    idx[0, 5:8] = -1
    req = torch.tensor([0, 1, 2, -1], dtype=torch.int32)
    qn, qp = torch.randn(4, H, L, generator=g), torch.randn(4, H, R, generator=g)
    return qn, qp, codes, scales, bt, req, idx


@interp
@pytest.mark.parametrize("dt, splits, use_dot", [(torch.int8, 3, False), (torch.float8_e4m3fn, 1, False),
                                                 (torch.float8_e4m3fn, 2, True), (torch.int8, 1, True)],
                         ids=["int8-split3", "fp8-unsplit", "fp8-split2-dot", "int8-unsplit-dot"])
def test_triton_sparse_mla_dequantises_on_load(dt, splits, use_dot):
    """The sparse MLA kernel over int8 / fp8 codes == the torch reference dequantising `code *
    scale` in fp32: split launches (partials merged by LSE) and one split, broadcast and tl.dot."""
    qn, qp, codes, scales, bt, req, idx = _sparse_case(dt, 40)
    kw = dict(block_h=16, block_n=16) if use_dot else {}
    call = dict(num_splits=splits, use_dot=use_dot, kv_scale_cache=scales, **kw)
    with capture_launches() as launches:  # captured, not run: the launch sequence and its QUANT flag
        sparse_mla_rows_triton(qn, qp, codes, bt, req, idx, 0.2, **call)
    assert [lc.kernel.fn.__name__ for lc in launches] == ["_sparse_mla_kernel"] + (
        ["_sparse_split_merge_kernel"] if splits > 1 else [])
    out, lse = sparse_mla_rows_triton(qn, qp, codes, bt, req, idx, 0.2, **call)
    want_out, want_lse = sparse_reference.sparse_attention_rows_with_lse(torch.cat([qn, qp], -1), codes, bt, req, idx,
                                                                          40, 0.2, scales)
    assert not torch.isnan(out).any() and torch.isneginf(lse[2:]).all() and (out[2:] == 0).all()
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # The reference is the dequantised cache read in fp32 (its oracle, independent of the kernel).
    deq = kv_quant.dequantize(codes, scales[..., 0])
    plain = sparse_reference.sparse_attention_rows_with_lse(torch.cat([qn, qp], -1), deq, bt, req, idx, 40, 0.2)
    torch.testing.assert_close(want_out, plain[0], atol=1e-6, rtol=1e-6)


@interp
def test_triton_sparse_single_device_and_partial_ops_on_a_quantised_cache():
    """The launch adapters of `cp::sparse_mla_attention_quant` (quantising write + attention), of
    `cp::sparse_mla_partial_attention` and of DSA-CP's `cp::sparse_mla_rows_attention` with their
    scale cache == the CPU ops (codes byte-equal)."""
    g = torch.Generator().manual_seed(3)
    m = two_step_metas("mixed", dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)[1]
    T = m.num_tokens
    qn, qp, kv_c, k_pe = (torch.randn(T, 4, 16, generator=g), torch.randn(T, 4, 8, generator=g),
                          torch.randn(T, 16, generator=g), torch.randn(T, 8, generator=g))
    topk = torch.randint(-1, 12, (T, 5), generator=g, dtype=torch.int32)
    for dt in DTYPES:
        codes, scales = torch.zeros(NUM_BLOCKS, BLOCK, 24, dtype=dt), torch.zeros(NUM_BLOCKS, BLOCK, 1)
        want_c, want_s = codes.clone(), scales.clone()
        got = sparse_launch.sparse_mla_attention_quant(qn, qp, kv_c, k_pe, codes, scales, *meta_args(m), topk, 0.3)
        want = torch.ops.cp.sparse_mla_attention_quant(qn, qp, kv_c, k_pe, want_c, want_s, *meta_args(m), topk, 0.3)
        assert torch.equal(codes.view(torch.uint8), want_c.view(torch.uint8))
        torch.testing.assert_close(scales, want_s, atol=0, rtol=1e-6)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        got = sparse_launch.sparse_mla_partial_attention(qn, qp, codes, m.block_table, m.query_start_loc, topk, 0.3,
                                                         scales)
        want = torch.ops.cp.sparse_mla_partial_attention(qn, qp, codes, m.block_table, m.query_start_loc, topk, 0.3,
                                                         scales)
        torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
        # DSA-CP's row shard (tp 2, rank 1: the second half of the tokens) with the scale cache
        rows = layout.token_shard_rows(T, tp=2)
        args = (qn[:rows], qp[:rows], codes, m.block_table, m.seq_lens, m.query_start_loc, topk[:rows], 2, 1, 0.3,
                scales)
        torch.testing.assert_close(sparse_launch.sparse_mla_rows_attention(*args),
                                   torch.ops.cp.sparse_mla_rows_attention(*args), atol=1e-5, rtol=1e-5)


@interp
def test_npu_sparse_quant_entries_take_int8_and_refuse_fp8_by_name(monkeypatch):
    """The NPU entries of SFA over a quantised latent (decision 75), run here on CPU tensors under
    the interpreter: `cp::sparse_mla_attention_quant`'s (the write through `cp::quant_cache_write`,
    the Triton read) == the op for int8 (codes byte-equal); fp8 refused naming the op and the fix
    before anything is written, and the partial's / rows' entries refuse fp8 on an NPU target (their int8
    reads: `test_triton_sparse_single_device_and_partial_ops_on_a_quantised_cache`)."""
    from cp_compile.ops.sparse import triton_sparse_mla

    g = torch.Generator().manual_seed(5)
    m = two_step_metas("mixed", dcp=1, block_size=BLOCK, num_blocks=NUM_BLOCKS)[1]
    T = m.num_tokens
    qn, qp, kv_c, k_pe = (torch.randn(T, 4, 16, generator=g), torch.randn(T, 4, 8, generator=g),
                          torch.randn(T, 16, generator=g), torch.randn(T, 8, generator=g))
    topk = torch.randint(-1, 12, (T, 5), generator=g, dtype=torch.int32)
    codes, scales = torch.zeros(NUM_BLOCKS, BLOCK, 24, dtype=torch.int8), torch.zeros(NUM_BLOCKS, BLOCK, 1)
    want_c, want_s = codes.clone(), scales.clone()
    got = sparse_launch.sparse_mla_attention_quant_npu(qn, qp, kv_c, k_pe, codes, scales, *meta_args(m), topk, 0.3)
    want = torch.ops.cp.sparse_mla_attention_quant(qn, qp, kv_c, k_pe, want_c, want_s, *meta_args(m), topk, 0.3)
    assert torch.equal(codes, want_c) and codes.abs().sum() > 0
    torch.testing.assert_close(scales, want_s, atol=0, rtol=1e-6)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    fp8 = torch.zeros(NUM_BLOCKS, BLOCK, 24, dtype=torch.float8_e4m3fn)
    sc = torch.zeros(NUM_BLOCKS, BLOCK, 1)
    with pytest.raises(NotImplementedError, match=r"cp::sparse_mla_attention_quant: .*float8_e4m3fn.*"
                                                  r"kv_cache_dtype='int8'"):
        sparse_launch.sparse_mla_attention_quant_npu(qn, qp, kv_c, k_pe, fp8, sc, *meta_args(m), topk, 0.3)
    assert not fp8.view(torch.uint8).any() and not sc.any()  # nothing written
    # The partial / rows entries: fp8 refused where the device is an NPU (target_of stood in).
    monkeypatch.setattr(triton_sparse_mla, "target_of", lambda device: ("npu", None))
    with pytest.raises(NotImplementedError, match=r"cp::sparse_mla_partial_attention: .*float8_e4m3fn"):
        sparse_launch.sparse_mla_partial_attention(qn, qp, fp8, m.block_table, m.query_start_loc, topk, 0.3, sc)
    rows = layout.token_shard_rows(T, tp=2)
    with pytest.raises(NotImplementedError, match=r"cp::sparse_mla_rows_attention: .*float8_e4m3fn"):
        sparse_launch.sparse_mla_rows_attention(qn[:rows], qp[:rows], fp8, m.block_table, m.seq_lens,
                                                m.query_start_loc, topk[:rows], 2, 1, 0.3, sc)


@pytest.mark.skipif(IN_PROCESS or os.environ.get(_CHILD_ENV) == "1", reason="checked in-process under the interpreter")
def test_quant_kernels_in_fresh_interpreter() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_ENV: "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider",
                           "-n", "0"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]
