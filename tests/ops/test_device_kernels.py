"""Every cp:: op's accelerator kernel against its CPU reference, under Triton's interpreter (issue 22).

Each op's registered device kernel (`registry.DEVICE_KERNELS`) runs on CPU tensors
under TRITON_INTERPRET=1 and is compared with the op's CPU implementation (the
torch reference) on the same case (`cp_compile.testing.op_cases`): outputs and the
caches written in place. Then the edge cases of the new kernels (tiles straddling
requests, tl.dot and broadcast paths, half precision, empty rows), and the host-read
check: every device kernel's host code runs under `HostReadMode` (and
`FactoryDeviceMode`) with the launches captured, and the check is shown failing on
an injected `.tolist()`. Interpreter handling as in test_kernels.py.
"""

from __future__ import annotations

import os
import sys

import torch

_CHILD_ENV = "CP_COMPILE_DEVICE_KERNEL_TESTS_CHILD"
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import cp_compile.ops  # noqa: E402,F401
from cp_compile.ops.core import layout  # noqa: E402
from cp_compile.ops.quant import reference as quant_reference  # noqa: E402
from cp_compile.ops.core import paged_cache  # noqa: E402
from cp_compile.ops.paged import reference as paged_reference  # noqa: E402
from cp_compile.ops.sparse import reference as sparse_reference  # noqa: E402
from cp_compile.ops.core import registry  # noqa: E402
from cp_compile.ops.core.launcher import triton_available  # noqa: E402
from cp_compile.ops.paged import launch as paged_launch  # noqa: E402
from cp_compile.testing.device_modes import FactoryDeviceMode, HostRead, HostReadMode  # noqa: E402
from cp_compile.testing.op_cases import clone_args, flat_outputs, op_cases  # noqa: E402

assert triton_available(), "triton is not installed: pip install -e '.[test]'"

from cp_compile.ops.core.triton_common import capture_launches, interpreter_active  # noqa: E402

IN_PROCESS = interpreter_active()
interp = pytest.mark.skipif(not IN_PROCESS, reason="triton imported without TRITON_INTERPRET=1: "
                            "covered by test_device_kernels_in_fresh_interpreter")


def _cpu_reference(op: str):
    return getattr(torch.ops.cp, op.split("::")[1]).default  # CPU tensors -> the torch reference


def _assert_same(op: str, got, want) -> None:
    for i, (g, w) in enumerate(zip(flat_outputs(got), flat_outputs(want), strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, (op, i, g.shape, w.shape, g.dtype, w.dtype)
        if not g.is_floating_point():
            assert torch.equal(g, w), (op, i, g, w)
        else:
            assert torch.equal(torch.isneginf(g), torch.isneginf(w)), (op, i)
            fin = torch.isfinite(w)
            torch.testing.assert_close(g[fin], w[fin], atol=2e-5, rtol=1e-5, msg=lambda m: f"{op} output {i}: {m}")


def test_every_op_has_a_device_kernel() -> None:
    # A new cp:: op fails here until it has a device kernel and a case (16 today), or declares
    # that it has none and why (cp::pcp_token_index: a graph marker the PCP pass removes).
    absent = registry.ops_without_kernel()
    assert all(why.strip() for why in absent.values()), absent
    assert set(registry.DEVICE_KERNELS) | set(absent) == set(registry.cp_ops())
    assert not set(registry.DEVICE_KERNELS) & set(absent)
    assert len(registry.DEVICE_KERNELS) >= 16
    assert set(op_cases()) == set(registry.DEVICE_KERNELS)


@interp
@pytest.mark.parametrize("op", sorted(op_cases()))
def test_device_kernel_matches_reference(op: str) -> None:
    args, mutated = op_cases()[op]
    ref_args, dev_args = clone_args(args), clone_args(args)
    want = _cpu_reference(op)(*ref_args)
    got = registry.DEVICE_KERNELS[op](*dev_args)
    _assert_same(op, got, want)
    for i in mutated:  # a cache the op writes: same slots, same values (computed ones within fp32 rounding:
        # cp::mla_preprocess writes its normed / rotated latent, 1 ulp apart on some inputs)
        torch.testing.assert_close(dev_args[i], ref_args[i], atol=2e-6, rtol=1e-6,
                                   msg=lambda m: f"{op}: cache argument {i} written differently: {m}")


# ----------------------------------------------------------------------------- edge cases


@interp
@pytest.mark.parametrize("block_m", [16, 32])
def test_paged_prefill_tiles_per_request(block_m: int) -> None:
    """Chunked prefill over a paged context: 4 requests (1 .. 20 new tokens over 0 .. 30
    cached), GQA group 3, padded head dims, two padding tokens, through the registry's
    paged-attention kernel (T >= 4 B takes the query-tiled kernel) and directly."""
    from cp_compile.ops.paged.triton_prefill import paged_prefill_attention_lse_triton

    g = torch.Generator().manual_seed(7)
    lens, ctx = [1, 20, 3, 17], [5, 0, 30, 9]
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([a + b for a, b in zip(lens, ctx)], dtype=torch.int32)
    T, Hq, Hkv, D, Dv, BS, NB = int(qsl[-1]) + 2, 6, 2, 24, 20, 4, 48
    k_cache, v_cache = torch.randn(NB, BS, Hkv, D, generator=g), torch.randn(NB, BS, Hkv, Dv, generator=g)
    bt = torch.randperm(NB, generator=g)[:44].view(4, 11).to(torch.int32)
    q = torch.randn(T, Hq, D, generator=g)
    kv = layout.causal_lens(qsl, seq, T)
    want = paged_reference.paged_attention_with_lse(q, k_cache, v_cache, bt, qsl, kv, 0.3)
    assert T >= paged_launch.PREFILL_TOKENS_PER_REQUEST * 4
    _assert_same("registry", registry.DEVICE_KERNELS["cp::paged_attention_lse"](q, k_cache, v_cache, bt, qsl, kv, 0.3),
                 want)
    got = paged_prefill_attention_lse_triton(q, k_cache, v_cache, bt, qsl, kv, 0.3, block_m=block_m, block_n=16,
                                             num_programs=3)
    _assert_same("paged prefill", got, want)


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_sparse_mla_paths_and_empty_rows(use_dot: bool) -> None:
    """Both product paths; a row whose indices are all -1, a padding row, an index
    tile that is all -1 after valid ones (the online softmax must not NaN)."""
    from cp_compile.ops.sparse.triton_sparse_mla import sparse_mla_rows_triton

    g = torch.Generator().manual_seed(3)
    T, H, L, R, BS, NB, K = 5, 3, 24, 8, 4, 10, 40
    qn, qp, cache = torch.randn(T, H, L, generator=g), torch.randn(T, H, R, generator=g), torch.randn(NB, BS, L + R,
                                                                                                     generator=g)
    bt = torch.randperm(NB, generator=g)[:8].view(2, 4).to(torch.int32)
    req = torch.tensor([0, 0, 1, 1, -1], dtype=torch.int32)
    idx = torch.randint(0, 16, (T, K), generator=g, dtype=torch.int32)
    idx[0, 5:] = -1  # valid tile, then tiles of -1 only
    idx[2] = -1  # no index at all
    kw = dict(block_h=16, block_n=16) if use_dot else {}
    out, lse = sparse_mla_rows_triton(qn, qp, cache, bt, req, idx, 0.2, use_dot=use_dot, **kw)
    want = sparse_reference.sparse_attention_rows_with_lse(torch.cat([qn, qp], -1), cache, bt, req, idx, L, 0.2)
    _assert_same("sparse_mla", (out, lse), want)
    assert torch.isneginf(lse[2]).all() and torch.isneginf(lse[4]).all()


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_indexer_topk_exact_with_ties(use_dot: bool) -> None:
    """Integer-valued inputs: scores are exact, many tie; the top-k must equal the
    reference's stable order index for index, with -1 past each row's keys and for
    padding rows; topk wider than the cache width pads with -1."""
    from cp_compile.ops.sparse.triton_indexer import indexer_topk_rows

    g = torch.Generator().manual_seed(4)
    T, Hi, Di, BS, NB = 7, 4, 16, 4, 12
    q = torch.randint(-2, 3, (T, Hi, Di), generator=g).float()
    w = torch.randint(-2, 3, (T, Hi), generator=g).float()
    cache = torch.randint(-2, 3, (NB, BS, Di), generator=g).float()
    bt = torch.randperm(NB, generator=g)[:8].view(2, 4).to(torch.int32)
    qsl, seq = torch.tensor([0, 2, 6], dtype=torch.int32), torch.tensor([9, 15], dtype=torch.int32)
    req, kv = layout.request_index(qsl, T), layout.causal_lens(qsl, seq, T)
    for topk in (5, 20):
        got = indexer_topk_rows(q, cache, w, bt, req, kv, topk, use_dot=use_dot)
        assert torch.equal(got, sparse_reference.lightning_indexer_topk_rows(q, cache, w, bt, req, kv, topk))


@interp
@pytest.mark.parametrize("M,K,N,G", [(1, 40, 24, 1), (37, 100, 40, 2)])
def test_int8_matmul_exact(M: int, K: int, N: int, G: int) -> None:
    from cp_compile.ops.quant.triton_int8_matmul import int8_matmul_triton

    g = torch.Generator().manual_seed(5)
    a = torch.randint(-127, 128, (G, M, K), generator=g, dtype=torch.int8)
    b = torch.randint(-127, 128, (G, K, N), generator=g, dtype=torch.int8)
    got = int8_matmul_triton(a, b, block_m=16, block_n=16, block_k=32, num_programs=4)
    assert torch.equal(got, quant_reference.int8_matmul(a, b))


@interp
def test_cache_write_dtype_and_skips() -> None:
    from cp_compile.ops.core.triton_cache_write import cache_write_triton

    g = torch.Generator().manual_seed(6)
    cache = torch.zeros(3, 4, 40, dtype=torch.bfloat16)
    new = torch.randn(7, 40, generator=g)  # fp32 rows into a bf16 cache; one row more than slots
    slots = torch.tensor([11, -1, 0, 5, -1, 6])
    want = cache.clone()
    paged_cache.write_cache(want, new, slots)
    cache_write_triton(new, cache, slots, block=16, num_programs=2)
    assert torch.equal(cache, want)


# ----------------------------------------------------------------------------- no host reads


def _run_host_side(fn, args):
    """Run a device kernel's host code with every launch captured (not executed): what
    remains is exactly what would run on the host around the kernels on a GPU."""
    with capture_launches() as launches, FactoryDeviceMode() as factories, HostReadMode():
        fn(*args)
    return launches, factories.missing


@pytest.mark.parametrize("op", sorted(op_cases()))
def test_device_kernel_has_no_host_read(op: str) -> None:
    args, _ = op_cases()[op]
    launches, missing = _run_host_side(registry.DEVICE_KERNELS[op], clone_args(args))
    assert missing == [], f"{op}: tensor factories without device=: {missing}"
    # Ops that are pure torch on the device launch no Triton kernel.
    assert launches or op in ("cp::dcp_sparse_indices",), f"{op}: no kernel launched"


def test_host_read_check_fails_on_an_injected_tolist() -> None:
    args, _ = op_cases()["cp::paged_attention_lse"]
    kernel = registry.DEVICE_KERNELS["cp::paged_attention_lse"]

    def with_tolist(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale):
        query_start_loc.tolist()  # the injected host read
        return kernel(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale)

    _run_host_side(kernel, clone_args(args))  # clean
    with pytest.raises(HostRead, match=r"tolist\(\)"):
        _run_host_side(with_tolist, clone_args(args))


def test_references_do_host_reads() -> None:
    """The check is not vacuous: the CPU references it replaces on a device do read the host."""
    args, _ = op_cases()["cp::paged_attention_lse"]
    with pytest.raises(HostRead):
        with HostReadMode():
            paged_reference.paged_attention_with_lse(*clone_args(args))


# ----------------------------------------------------------------------------- fallback


@pytest.mark.skipif(IN_PROCESS or os.environ.get(_CHILD_ENV) == "1",
                    reason="checked in-process under the interpreter")
def test_device_kernels_in_fresh_interpreter() -> None:
    """Triton was imported here without TRITON_INTERPRET=1: rerun this file in a fresh
    interpreter where it is set before the first triton import."""
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_ENV: "1", "OPENBLAS_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]
