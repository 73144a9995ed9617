"""Triton kernels (ops/<family>/triton_*.py) against the torch references, on CPU.

The kernels run under Triton's interpreter (docs/architecture.md §8). TRITON_INTERPRET is read
when `@triton.jit` decorates a function, i.e. when triton.language (whose tl.sum,
tl.max, tl.zeros ... are themselves jitted) and the kernel modules are first
imported, not at launch. So:
- run alone (or first to import triton) on a machine without CUDA, this file sets
  the variable before anything imports triton and checks in-process;
- if triton was already imported without it (another test module, op registration),
  or a CUDA device is present (the variable would turn every later Triton kernel of
  the session into an interpreted one), the in-process checks skip and one test
  reruns this file in a fresh interpreter with the variable set.
"""

from __future__ import annotations

import os
import sys

import torch

_CHILD_ENV = "CP_COMPILE_KERNEL_TESTS_CHILD"
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from cp_compile.ops.core import layout  # noqa: E402
from cp_compile.ops.merge import reference as merge_reference  # noqa: E402
from cp_compile.ops.paged import reference as paged_reference  # noqa: E402
from cp_compile.ops.core.launcher import triton_available  # noqa: E402

# triton is part of the test extra: a missing install must fail, not skip.
assert triton_available(), "triton is not installed: pip install -e '.[test]'"

from cp_compile.ops.merge.triton_merge import lse_rescale_triton, merge_partials_triton
from cp_compile.ops.paged.triton_decode import paged_attention_with_lse_triton
from cp_compile.ops.paged.triton_localize import local_slot_mapping_triton
from cp_compile.ops.core.triton_common import interpreter_active  # noqa: E402

IN_PROCESS = interpreter_active()
interp = pytest.mark.skipif(not IN_PROCESS, reason="triton imported without TRITON_INTERPRET=1: "
                            "covered by test_kernels_in_fresh_interpreter")

NEG_INF = float("-inf")
NAN = float("nan")


# ----------------------------------------------------------------------------- oracles


def lse_rescale_ref(out: torch.Tensor, lse: torch.Tensor, lse_all: torch.Tensor) -> torch.Tensor:
    """out * exp(lse - logsumexp_n lse_all) in fp32; an empty (-inf) own shard or all-empty row -> 0;
    a NaN / +inf LSE among the shards -> NaN (strict, decision 47)."""
    lse_all, own = lse_all.float(), lse.float()
    invalid = (torch.isnan(lse_all) | torch.isposinf(lse_all)).any(dim=0)
    total = torch.where(invalid, torch.tensor(NAN), torch.logsumexp(lse_all, dim=0))  # -inf: every shard empty
    empty = own == NEG_INF
    w = torch.where(empty, torch.zeros_like(own), torch.exp(own - total))
    return torch.where(empty[..., None], torch.zeros((), dtype=torch.float32), out.float() * w[..., None])


def merge_ref(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """The torch oracle: empty (-inf) partials weigh 0, all-empty rows 0, NaN / +inf rows NaN."""
    return merge_reference.merge_partials(outs, lses)


def clean_logsumexp(lses: torch.Tensor) -> torch.Tensor:
    return merge_reference.merged_lse(lses)


# ----------------------------------------------------------------------------- batch builders


def make_paged_batch(gen: torch.Generator, *, seq_lens: list[int], q_lens: list[int], pad: int,
                     block_size: int, num_blocks: int) -> dict[str, torch.Tensor]:
    """Flattened batch with causal kv_lens, shuffled pages and `pad` padding tokens.

    kv_lens of padding tokens are set nonzero on purpose: the kernel must ignore them.
    """
    B = len(seq_lens)
    nb = max((s + block_size - 1) // block_size for s in seq_lens)
    pages = torch.randperm(num_blocks, generator=gen)[: B * nb].view(B, nb).to(torch.int32)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    T = int(qsl[-1]) + pad
    kv_lens = layout.causal_lens(qsl, torch.tensor(seq_lens, dtype=torch.int32), T)
    kv_lens[int(qsl[-1]):] = 5  # padding: garbage that must not be read
    return {"block_table": pages, "query_start_loc": qsl, "kv_lens": kv_lens, "T": T}


def assert_close_report(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float = 0.0,
                        equal_nan: bool = False) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    same_inf = torch.isinf(want) == torch.isinf(got)
    assert bool(same_inf.all()), f"{name}: -inf pattern differs"
    fin = torch.isfinite(want)
    err = (got[fin].double() - want[fin].double()).abs().max().item() if fin.any() else 0.0
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, equal_nan=equal_nan, msg=lambda m: f"{name}: {m}")
    print(f"{name}: max abs err {err:.3e}")


# ----------------------------------------------------------------------------- paged attention


@interp
@pytest.mark.parametrize("num_programs", [1, 3, None])
def test_paged_gqa_decode_mixed(num_programs: int | None) -> None:
    """GQA group 3 (not a power of two), D=24 / Dv=20, several requests and query
    tokens per request, a request with no keys at all, padding tokens, pages shuffled
    and tiles crossing page boundaries (block_n 8 > block_size 4)."""
    gen = torch.Generator().manual_seed(0)
    Hq, Hkv, D, Dv, BS, NB = 6, 2, 24, 20, 4, 24
    batch = make_paged_batch(gen, seq_lens=[11, 1, 6, 14], q_lens=[3, 1, 1, 2], pad=2, block_size=BS, num_blocks=NB)
    T = batch["T"]
    kv_lens = batch["kv_lens"].clone()
    kv_lens[3] = 0  # the second request's only token: an empty row inside a request
    q = torch.randn(T, Hq, D, generator=gen)
    k = torch.randn(NB, BS, Hkv, D, generator=gen)
    v = torch.randn(NB, BS, Hkv, Dv, generator=gen)
    args = (q, k, v, batch["block_table"], batch["query_start_loc"], kv_lens, D ** -0.5)
    out, lse = paged_attention_with_lse_triton(*args, num_programs=num_programs, block_n=8)
    ref_out, ref_lse = paged_reference.paged_attention_with_lse(*args)
    assert_close_report("gqa out", out, ref_out, atol=2e-6, rtol=1e-5)
    assert_close_report("gqa lse", lse, ref_lse, atol=2e-6, rtol=1e-5)
    assert bool((out[3] == 0).all()) and bool(torch.isneginf(lse[3]).all())
    assert bool((out[-2:] == 0).all()) and bool(torch.isneginf(lse[-2:]).all())  # padding


@interp
@pytest.mark.parametrize("Hq,Hkv,BS,D", [(4, 4, 1, 16), (8, 1, 3, 7), (6, 3, 5, 33)])
def test_paged_shape_sweep(Hq: int, Hkv: int, BS: int, D: int) -> None:
    """MHA, MQA and GQA; page sizes 1, 3, 5 (a tile spans many pages); odd head dims."""
    gen = torch.Generator().manual_seed(100 + D)
    NB = 64  # page size 1: up to 3 * 17 pages
    seq_lens = torch.randint(1, 18, (3,), generator=gen).tolist()
    batch = make_paged_batch(gen, seq_lens=seq_lens, q_lens=[1, min(2, seq_lens[1]), 1], pad=1,
                             block_size=BS, num_blocks=NB)
    q = torch.randn(batch["T"], Hq, D, generator=gen)
    k = torch.randn(NB, BS, Hkv, D, generator=gen)
    v = torch.randn(NB, BS, Hkv, D, generator=gen)
    args = (q, k, v, batch["block_table"], batch["query_start_loc"], batch["kv_lens"], 0.5)
    out, lse = paged_attention_with_lse_triton(*args, block_n=8)
    ref_out, ref_lse = paged_reference.paged_attention_with_lse(*args)
    assert_close_report(f"sweep out {Hq}/{Hkv}/{BS}/{D}", out, ref_out, atol=2e-6, rtol=1e-5)
    assert_close_report(f"sweep lse {Hq}/{Hkv}/{BS}/{D}", lse, ref_lse, atol=2e-6, rtol=1e-5)


@interp
def test_paged_head_blocks_and_strided_q_fp16() -> None:
    """fp16 inputs (out stays fp16, lse fp32), a non-contiguous q, and a GQA group of
    6 split over two head blocks of 4 (the second one partly masked)."""
    gen = torch.Generator().manual_seed(1)
    Hq, Hkv, D, BS, NB = 12, 2, 16, 8, 10
    batch = make_paged_batch(gen, seq_lens=[19, 9], q_lens=[2, 1], pad=1, block_size=BS, num_blocks=NB)
    T = batch["T"]
    q = torch.randn(T, Hq, D + 8, generator=gen).half()[..., 3: 3 + D]
    assert not q.is_contiguous()
    k = torch.randn(NB, BS, Hkv, D, generator=gen).half()
    v = torch.randn(NB, BS, Hkv, D, generator=gen).half()
    args = (q, k, v, batch["block_table"], batch["query_start_loc"], batch["kv_lens"], 0.25)
    out, lse = paged_attention_with_lse_triton(*args, block_h=4, block_n=4, num_programs=2)
    ref_out, ref_lse = paged_reference.paged_attention_with_lse(*args)
    assert out.dtype == torch.float16 and lse.dtype == torch.float32
    assert_close_report("fp16 out", out, ref_out, atol=2e-3, rtol=2e-3)
    assert_close_report("fp16 lse", lse, ref_lse, atol=1e-5, rtol=1e-5)


@interp
def test_paged_mla_view_layout() -> None:
    """MLA (absorbed): one latent cache [NB, BS, L+R] read as K = [c; k_pe] and
    V = c through a non-contiguous slice view, L+R = 26 and L = 20 not powers of two."""
    gen = torch.Generator().manual_seed(2)
    H, L, R, BS, NB = 5, 20, 6, 4, 16
    batch = make_paged_batch(gen, seq_lens=[9, 13, 3], q_lens=[1, 2, 1], pad=1, block_size=BS, num_blocks=NB)
    T = batch["T"]
    kv_cache = torch.randn(NB, BS, L + R, generator=gen)
    k_cache = kv_cache.unsqueeze(2)  # [NB, BS, 1, L+R]
    v_cache = kv_cache[..., :L].unsqueeze(2)  # [NB, BS, 1, L], a view
    assert not v_cache.is_contiguous() and v_cache.data_ptr() == kv_cache.data_ptr()
    q = torch.randn(T, H, L + R, generator=gen)  # [q_nope_absorbed; q_pe]
    args = (q, k_cache, v_cache, batch["block_table"], batch["query_start_loc"], batch["kv_lens"], 0.3)
    out, lse = paged_attention_with_lse_triton(*args)
    ref_out, ref_lse = paged_reference.paged_attention_with_lse(*args)
    assert out.shape == (T, H, L)
    assert_close_report("mla out", out, ref_out, atol=2e-6, rtol=1e-5)
    assert_close_report("mla lse", lse, ref_lse, atol=2e-6, rtol=1e-5)


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paged_mla_tl_dot_path(dtype: torch.dtype) -> None:
    """use_dot=True (16 heads x 16 keys tiles, as a wide-head MLA would use on device):
    operands in their own dtype, fp32 accumulation; half precision also rounds P
    before P @ V. fp16, not bf16: the upstream interpreter's tl.dot reads bf16
    operands as raw integers (triton 3.9: error 2.8e10 on a 16x16 product)."""
    gen = torch.Generator().manual_seed(3)
    H, L, R, BS, NB = 16, 24, 8, 8, 8
    batch = make_paged_batch(gen, seq_lens=[21, 5], q_lens=[1, 1], pad=0, block_size=BS, num_blocks=NB)
    kv_cache = torch.randn(NB, BS, L + R, generator=gen).to(dtype)
    q = torch.randn(batch["T"], H, L + R, generator=gen).to(dtype)
    args = (q, kv_cache.unsqueeze(2), kv_cache[..., :L].unsqueeze(2), batch["block_table"],
            batch["query_start_loc"], batch["kv_lens"], 0.2)
    out, lse = paged_attention_with_lse_triton(*args, block_h=16, block_n=16, use_dot=True)
    ref_out, ref_lse = paged_reference.paged_attention_with_lse(*args)
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert_close_report("dot out", out.float(), ref_out.float(), atol=tol, rtol=tol)
    assert_close_report("dot lse", lse, ref_lse, atol=tol, rtol=tol)


@interp
def test_dcp_decode_end_to_end() -> None:
    """dcp=2, interleave=2: shard a paged cache by the layout math, run the kernel per
    rank on local lengths, merge with the kernel: equals single-device attention."""
    gen = torch.Generator().manual_seed(4)
    N, I, Bk, Hq, Hkv, D, NB = 2, 2, 4, 4, 2, 12, 6
    seq_lens = torch.tensor([13, 7, 1], dtype=torch.int32)
    qsl = torch.tensor([0, 2, 3, 4], dtype=torch.int32)  # 2 spec tokens for request 0
    T = 5  # one padding token
    B = seq_lens.shape[0]
    nb = 2  # virtual blocks of Bk*N = 8 tokens
    block_table = torch.randperm(NB, generator=gen)[: B * nb].view(B, nb).to(torch.int32)
    k_glob = torch.randn(NB, Bk * N, Hkv, D, generator=gen)  # single-device cache, page = virtual block
    v_glob = torch.randn(NB, Bk * N, Hkv, D, generator=gen)
    q = torch.randn(T, Hq, D, generator=gen)
    scale = D ** -0.5
    ref_out, _ = paged_reference.paged_attention_with_lse(
        q, k_glob, v_glob, block_table, qsl, layout.causal_lens(qsl, seq_lens, T), scale)

    outs, lses = [], []
    for r in range(N):
        k_loc = torch.zeros(NB, Bk, Hkv, D)
        v_loc = torch.zeros(NB, Bk, Hkv, D)
        for b in range(B):
            p = torch.arange(int(seq_lens[b]))
            mine = layout.token_owner(p, cp=N, interleave=I, block_size=Bk) == r
            pages = block_table[b, (p // (Bk * N)).long()].long()
            off = layout.local_offset(p, cp=N, interleave=I, block_size=Bk)
            k_loc[pages[mine], off[mine]] = k_glob[pages[mine], (p % (Bk * N))[mine]]
            v_loc[pages[mine], off[mine]] = v_glob[pages[mine], (p % (Bk * N))[mine]]
        local_lens = layout.local_causal_lens(qsl, seq_lens, T, cp=N, rank=r, interleave=I)
        o, l = paged_attention_with_lse_triton(q, k_loc, v_loc, block_table, qsl, local_lens, scale)
        outs.append(o)
        lses.append(l)
    merged = merge_partials_triton(torch.stack(outs), torch.stack(lses))
    assert_close_report("dcp e2e", merged, ref_out, atol=5e-6, rtol=1e-5)
    # The AG+RS path: every rank rescales its own partial, the sum is the same merge.
    summed = sum(lse_rescale_triton(outs[r], lses[r], torch.stack(lses)) for r in range(N))
    assert_close_report("dcp e2e rescale", summed, ref_out, atol=5e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- split-KV decode
# (docs/decisions.md 54): the keys a request can have are cut into num_splits ranges,
# one work item each, and a second kernel merges the partials by LSE.


def split_case(gen: torch.Generator, *, seq_lens: list[int], group: int, Hkv: int = 1, D: int = 16,
               BS: int = 4, width: int | None = None, dtype: torch.dtype = torch.float32) -> tuple:
    """One decode token per request; a block table `width` pages wide (default: the
    longest request's), pages shuffled; NaN in every slot no request owns (an empty or
    out-of-range split that read one would poison its row)."""
    B = len(seq_lens)
    nb = width or max(1, max((s + BS - 1) // BS for s in seq_lens))
    NB = B * nb + 2
    pages = torch.randperm(NB, generator=gen)[: B * nb].view(B, nb).to(torch.int32)
    k = torch.full((NB, BS, Hkv, D), NAN)
    v = torch.full((NB, BS, Hkv, D), NAN)
    for b, n in enumerate(seq_lens):
        for j in range(n):
            p, o = int(pages[b, j // BS]), j % BS
            k[p, o] = torch.randn(Hkv, D, generator=gen)
            v[p, o] = torch.randn(Hkv, D, generator=gen)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    kv_lens = torch.tensor(seq_lens, dtype=torch.int32)
    q = torch.randn(B, group * Hkv, D, generator=gen)
    return tuple(x.to(dtype) if x.is_floating_point() else x for x in (q, k, v)) + (pages, qsl, kv_lens, D ** -0.5)


def check_split(name: str, args: tuple, atol: float = 1e-5, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel vs the reference (on the fp32 cache: the oracle reads only owned slots)."""
    out, lse = paged_attention_with_lse_triton(*args, **kw)
    ref_out, ref_lse = paged_reference.paged_attention_with_lse(
        *(a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args))
    assert not bool(torch.isnan(out).any()) and not bool(torch.isnan(lse).any()), f"{name}: NaN"
    assert_close_report(f"{name} out", out.float(), ref_out, atol=atol, rtol=atol)
    assert_close_report(f"{name} lse", lse, ref_lse, atol=atol, rtol=atol)
    return out, lse


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_split_kv_splits_end_mid_block(use_dot: bool) -> None:
    """48 keys in 5 splits of 10: every split boundary falls inside a page (4) and inside
    a key tile (16), the last split is short (8); GQA group 8 padded to 16 on the dot path."""
    gen = torch.Generator().manual_seed(10)
    args = split_case(gen, seq_lens=[48, 45, 23], group=8, D=16)
    assert 48 % 5 and (48 // 5) % 4
    check_split("mid-block", args, num_splits=5, block_n=16, use_dot=use_dot)


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_split_kv_empty_splits(use_dot: bool) -> None:
    """A table 16 pages (64 keys) wide in 8 splits of 8 keys; requests of 3, 9 and 17 keys
    leave 7, 6 and 5 of their splits empty (lse -inf partials the merge must ignore; NaN
    sits in the slots past each request)."""
    gen = torch.Generator().manual_seed(11)
    args = split_case(gen, seq_lens=[3, 9, 17], group=4, width=16)
    check_split("empty splits", args, num_splits=8, block_n=16 if use_dot else 8, use_dot=use_dot)


@interp
@pytest.mark.parametrize("num_splits", [1, 4])
def test_split_kv_empty_shard(num_splits: int) -> None:
    """kv length 0 on this rank for every request (a DCP shard without keys), and one
    request empty beside a full one: out exactly 0, lse -inf, never NaN (decision 47)."""
    gen = torch.Generator().manual_seed(12)
    args = split_case(gen, seq_lens=[0, 0], group=8, width=4)
    out, lse = check_split("empty shard", args, num_splits=num_splits)
    assert bool((out == 0).all()) and bool(torch.isneginf(lse).all())
    args = split_case(gen, seq_lens=[0, 16], group=8, width=4)
    out, lse = check_split("half-empty shard", args, num_splits=num_splits)
    assert bool((out[0] == 0).all()) and bool(torch.isneginf(lse[0]).all())


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_split_kv_one_token_contexts(use_dot: bool) -> None:
    """One key per request in a 32-key-wide table: the first split holds it, the other
    7 are empty; the merged LSE is the single score, out the single value row."""
    gen = torch.Generator().manual_seed(13)
    args = split_case(gen, seq_lens=[1, 1, 1], group=8, width=8)
    out, _ = check_split("one token", args, num_splits=8, block_n=16, use_dot=use_dot)
    torch.testing.assert_close(out, args[2][args[3][:, 0].long(), 0, 0][:, None, :].expand_as(out))


@interp
@pytest.mark.parametrize("group", [1, 8, 16])
@pytest.mark.parametrize("use_dot", [False, True])
def test_split_kv_gqa_groups_mixed_lengths(group: int, use_dot: bool) -> None:
    """GQA groups 1 / 8 / 16 over 2 KV heads, four requests of different lengths (one of
    them a single key, one the full table) with the default split count (kv_splits on
    CPU_MAX_PROGRAMS cores), which must split here."""
    from cp_compile.ops.paged.triton_decode import kv_splits

    gen = torch.Generator().manual_seed(14 + group)
    args = split_case(gen, seq_lens=[37, 1, 64, 12], group=group, Hkv=2, width=16)
    block_n = 16 if use_dot else 8
    assert kv_splits(4 * 2, 64, 32)[0] > 1
    check_split(f"group {group}", args, block_n=block_n, use_dot=use_dot)


@interp
def test_split_kv_merge_column_blocks() -> None:
    """D = Dv = 80: the split merge's items are (rows, 64 columns), so a row's output is
    written by two items (the second masked past column 80) and its LSE by the first."""
    gen = torch.Generator().manual_seed(16)
    args = split_case(gen, seq_lens=[19, 30], group=2, D=80, width=8)
    check_split("Dv 80", args, num_splits=3)


@interp
@pytest.mark.parametrize("dtype,use_dot", [(torch.float32, False), (torch.float32, True), (torch.float16, True)])
def test_split_kv_mla_latent_and_rope_products(dtype: torch.dtype, use_dot: bool) -> None:
    """MLA decode (16 heads, latent 40 + rope 12: neither a power of two) split over the KV:
    the key row is two products (latent 64-padded, rope 16-padded, never 52 -> 64 as one),
    the latent tile is also V (read once); three requests, one empty, NaN past each."""
    from cp_compile.ops.core.triton_common import capture_launches

    gen = torch.Generator().manual_seed(17)
    H, L, R, BS = 16, 40, 12, 4
    seq_lens, width = [23, 0, 9], 8
    B = len(seq_lens)
    NB = B * width + 1
    pages = torch.randperm(NB, generator=gen)[: B * width].view(B, width).to(torch.int32)
    cache = torch.full((NB, BS, L + R), NAN)
    for b, n in enumerate(seq_lens):
        for j in range(n):
            cache[int(pages[b, j // BS]), j % BS] = torch.randn(L + R, generator=gen)
    q = torch.randn(B, H, L + R, generator=gen)
    c = cache.to(dtype)  # one tensor: the latent view shares its storage
    args = (q.to(dtype), c.unsqueeze(2), c[..., :L].unsqueeze(2), pages,
            torch.arange(B + 1, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), 0.15)
    kw = dict(num_splits=3, use_dot=use_dot, block_n=16 if use_dot else 8)
    with capture_launches() as launches:
        paged_attention_with_lse_triton(*args, **kw)
    assert {k: launches[0].kwargs[k] for k in ("D_PAD", "DV_PAD", "DR_PAD")} == dict(D_PAD=64, DV_PAD=64, DR_PAD=16)
    out, lse = paged_attention_with_lse_triton(*args, **kw)
    ref_out, ref_lse = paged_reference.paged_attention_with_lse(
        q.to(dtype).float(), c.float().unsqueeze(2), c.float()[..., :L].unsqueeze(2),
        *args[3:])
    tol = 1e-5 if dtype == torch.float32 else 5e-3
    assert not bool(torch.isnan(out).any())
    assert_close_report("mla split out", out.float(), ref_out, atol=tol, rtol=tol)
    assert_close_report("mla split lse", lse, ref_lse, atol=tol, rtol=tol)


def mla_split_case(gen: torch.Generator, seq_lens: list[int], H: int, L: int, R: int, BS: int, width: int,
                   dtype: torch.dtype) -> tuple[tuple, tuple]:
    """(kernel args, fp32 reference args) of an MLA decode batch: one latent + rope cache
    tensor (the latent view shares its storage), pages shuffled, NaN in every slot no
    request owns."""
    B = len(seq_lens)
    NB = B * width + 1
    pages = torch.randperm(NB, generator=gen)[: B * width].view(B, width).to(torch.int32)
    cache = torch.full((NB, BS, L + R), NAN)
    for b, n in enumerate(seq_lens):
        for j in range(n):
            cache[int(pages[b, j // BS]), j % BS] = torch.randn(L + R, generator=gen)
    q = torch.randn(B, H, L + R, generator=gen).to(dtype)
    c = cache.to(dtype)
    meta = (pages, torch.arange(B + 1, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32), 0.15)
    return ((q, c.unsqueeze(2), c[..., :L].unsqueeze(2), *meta),
            (q.float(), c.float().unsqueeze(2), c.float()[..., :L].unsqueeze(2), *meta))


@interp
@pytest.mark.parametrize("dtype,use_dot,num_splits", [(torch.float32, True, 5), (torch.float16, True, None),
                                                       (torch.bfloat16, False, 5)])
def test_split_kv_mla_head_blocks(dtype: torch.dtype, use_dot: bool, num_splits: int | None) -> None:
    """MLA decode with 48 heads: the tl.dot tile holds 32 heads (`_mla_dot_tiles`), so two
    head blocks (the second half masked) share each split's keys, neighbours in the
    grid. Four requests: 37 keys (5 splits of 10 over a 48-key table: every split ends
    inside a page of 4 and inside a 32-key tile), an empty shard (0 keys), a one-token
    context and 9 keys (its last splits empty); NaN in every slot no request owns.
    num_splits None: the default count (kv_splits on CPU_MAX_PROGRAMS cores). bf16 runs
    the broadcast product (the interpreter's tl.dot misreads bf16) with the same 32-head
    tile."""
    from cp_compile.ops.core.triton_common import capture_launches

    gen = torch.Generator().manual_seed(18)
    H, L, R = 48, 40, 12
    args, ref_args = mla_split_case(gen, [37, 0, 1, 9], H, L, R, BS=4, width=12, dtype=dtype)
    kw = dict(num_splits=num_splits, use_dot=use_dot, **({} if use_dot else dict(block_h=32, block_n=8)))
    with capture_launches() as launches:
        paged_attention_with_lse_triton(*args, **kw)
    att = launches[0]
    splits = att.arg("n_splits")
    assert att.kwargs["BLOCK_H"] == 32 and att.arg("n_hblk") == 2  # two head blocks of 32
    assert att.arg("n_work") == 4 * splits * 2 and (num_splits is None) == (splits != 5) and splits > 1
    if use_dot:
        assert att.kwargs["BLOCK_N"] == 32
    out, lse = paged_attention_with_lse_triton(*args, **kw)
    ref_out, ref_lse = paged_reference.paged_attention_with_lse(*ref_args)
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[dtype]
    assert not bool(torch.isnan(out).any()) and not bool(torch.isnan(lse).any())
    assert bool((out[1] == 0).all()) and bool((lse[1] == NEG_INF).all())  # the empty shard (decision 47)
    assert_close_report("mla head blocks out", out.float(), ref_out, atol=tol, rtol=tol)
    assert_close_report("mla head blocks lse", lse, ref_lse, atol=tol, rtol=tol)


@interp
def test_split_kv_bf16() -> None:
    """bf16 q / cache, fp32 partials, bf16 out (broadcast product: the interpreter's tl.dot
    misreads bf16 operands), 2e-2 against the fp32 reference on the same values."""
    gen = torch.Generator().manual_seed(15)
    args = split_case(gen, seq_lens=[41, 7, 30], group=8, D=32, width=12, dtype=torch.bfloat16)
    out, _ = check_split("bf16", args, atol=2e-2, num_splits=6)
    assert out.dtype == torch.bfloat16


def test_kv_splits_fill_whole_waves() -> None:
    """The split count from sizes only (decision 74): the DCP decode shape (8 requests x 1 KV
    head, 32k keys, 132 SMs) gets 2 waves (33 splits of 1008 keys, the last 512); MLA at 128
    heads (8 tokens x 4 head blocks) takes 12 splits, 384 programs in 3 nearly full rounds, not
    the 10 (320 programs, a third round 42 % full) that the wanted count rounded down gave; a
    batch that fills the waves alone, or a one-chunk table, stays unsplit; a short table stops
    at 16-key splits. Every pick covers the table with no empty split and is the cheapest
    candidate under the rule's cost (rounds x (length + 16)), recomputed here by brute force."""
    from cp_compile.ops.paged.triton_decode import kv_splits

    assert kv_splits(8, 32768, 132) == (33, 1008)
    assert kv_splits(8 * 4, 32768, 132) == (12, 2736)
    assert kv_splits(1, 131072, 132) == (256, 512)  # 1.94 waves beat 265 splits' third wave of one
    assert kv_splits(64 * 8, 131072, 132) == (1, 131072)
    assert kv_splits(1, 16, 132) == (1, 16)
    assert kv_splits(1, 1024, 132) == (64, 16)

    def cost(items: int, n: int, length: int) -> int:
        return -(-items * n // 132) * (length + 16)

    for items in (1, 3, 8, 17, 32, 64, 130):
        for keys in (8192, 32768, 131072):
            n, length = kv_splits(items, keys, 132)
            assert length % 16 == 0 and n * length >= keys > (n - 1) * length
            want = min(-(-264 // items), keys // 16)
            assert n >= 1 and (want <= 1) == (n == 1)
            if n > 1:  # no count in [want, 2 want] is cheaper
                for m in range(want, min(2 * want, keys // 16) + 1):
                    lm = -(-(-(-keys // m)) // 16) * 16
                    assert cost(items, n, length) <= cost(items, -(-keys // lm), lm)


# ----------------------------------------------------------------------------- merge


def make_partials(gen: torch.Generator, N: int, T: int, H: int, Dv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Partials with -inf shards, one all-empty row and an all-empty head column, and two
    invalid rows (POISONED: a NaN LSE at (1, 0), a +inf LSE at (3, 1)) that must come out NaN."""
    outs = torch.randn(N, T, H, Dv, generator=gen)
    lses = torch.randn(N, T, H, generator=gen) * 4
    lses[:, :3, H - 1] = NEG_INF  # last head empty on every shard for tokens 0..2
    lses[0, 0, 0] = NEG_INF
    lses[N - 1, 1, 0] = NAN  # a garbage partial: not an empty one (decision 47)
    lses[:, 2, 0] = NEG_INF  # all-empty row
    lses[0, 3, 1] = float("inf")
    # An empty shard's out may hold garbage; it must not leak into the result.
    outs[0, 0, 0] = NAN
    return outs, lses


def poisoned(T: int, H: int) -> torch.Tensor:
    """[T, H] True on make_partials' invalid rows."""
    mask = torch.zeros(T, H, dtype=torch.bool)
    mask[1, 0] = mask[3, 1] = True
    return mask


@interp
@pytest.mark.parametrize("N,T,H,Dv", [(1, 4, 2, 8), (3, 5, 3, 10), (4, 6, 2, 33)])
def test_merge_partials(N: int, T: int, H: int, Dv: int) -> None:
    gen = torch.Generator().manual_seed(10 + N)
    outs, lses = make_partials(gen, N, T, H, Dv)
    lse_out = torch.empty(T, H)
    got = merge_partials_triton(outs, lses, lse_out=lse_out, block_r=4, num_programs=2)
    bad = poisoned(T, H)
    assert got.dtype == torch.float32 and bool(torch.isnan(got[bad]).all()) and bool(torch.isfinite(got[~bad]).all())
    assert_close_report(f"merge N={N}", got, merge_ref(outs, lses), atol=2e-6, rtol=1e-5, equal_nan=True)
    assert bool((got[2, 0] == 0).all()) and bool((got[:3, H - 1] == 0).all())  # all-empty rows are exactly 0
    assert bool(torch.isnan(lse_out[bad]).all())
    assert_close_report(f"merge lse N={N}", lse_out, clean_logsumexp(lses), atol=2e-6, rtol=1e-6, equal_nan=True)
    # Shard order: any permutation gives the same result (up to fp32 rounding).
    perm = torch.randperm(N, generator=gen)
    torch.testing.assert_close(merge_partials_triton(outs[perm], lses[perm]), got, atol=1e-6, rtol=1e-6,
                               equal_nan=True)


@interp
def test_merge_partials_strided_low_precision() -> None:
    """bf16 partials through a permuted (non-contiguous) view, lses as a strided view."""
    gen = torch.Generator().manual_seed(20)
    N, T, H, Dv = 2, 3, 4, 6
    outs = torch.randn(T, N, H, Dv, generator=gen).bfloat16().transpose(0, 1)  # [N, T, H, Dv] view
    lses = torch.randn(H, N, T, generator=gen).permute(1, 2, 0)  # [N, T, H] view
    lses[1, 0, 2] = NEG_INF
    assert not outs.is_contiguous() and not lses.is_contiguous()
    got = merge_partials_triton(outs, lses)
    assert_close_report("merge bf16", got, merge_ref(outs, lses), atol=1e-6, rtol=1e-5)


@interp
@pytest.mark.parametrize("N", [1, 3])
def test_lse_rescale(N: int) -> None:
    gen = torch.Generator().manual_seed(30 + N)
    T, H, Dv = 5, 3, 10
    outs, lses = make_partials(gen, N, T, H, Dv)
    lse_out = torch.empty(T, H)
    for r in range(N):
        got = lse_rescale_triton(outs[r], lses[r], lses, lse_out=lse_out if r == 0 else None, num_programs=2)
        assert_close_report(f"rescale N={N} r={r}", got, lse_rescale_ref(outs[r], lses[r], lses), atol=2e-6,
                            rtol=1e-5, equal_nan=True)
    assert_close_report(f"rescale lse N={N}", lse_out, clean_logsumexp(lses), atol=2e-6, rtol=1e-6, equal_nan=True)
    total = sum(lse_rescale_triton(outs[r], lses[r], lses) for r in range(N))
    bad = poisoned(T, H)
    assert bool(torch.isnan(total[bad]).all()) and bool(torch.isfinite(total[~bad]).all())
    torch.testing.assert_close(total, merge_ref(outs, lses), atol=2e-6, rtol=1e-5, equal_nan=True)


@interp
def test_lse_rescale_head_major_gather_view() -> None:
    """lse_all as an all-gather buffer [N*H, T] (head-major per rank), passed as a view."""
    gen = torch.Generator().manual_seed(40)
    N, T, H, Dv = 2, 4, 3, 5
    gathered = torch.randn(N * H, T, generator=gen)
    gathered[H:, 1] = NEG_INF  # rank 1 empty on token 1
    lse_all = gathered.view(N, H, T).permute(0, 2, 1)  # [N, T, H]
    out = torch.randn(T, H, Dv, generator=gen)
    got = lse_rescale_triton(out, lse_all[1], lse_all)
    assert_close_report("rescale view", got, lse_rescale_ref(out, lse_all[1], lse_all), atol=2e-6, rtol=1e-5)
    assert bool((got[1] == 0).all())


# ----------------------------------------------------------------------------- slot mapping


@interp
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_local_slot_mapping(dcp: int) -> None:
    gen = torch.Generator().manual_seed(50 + dcp)
    block_size = 8
    for interleave in (1, 2, block_size):
        slots = torch.randint(0, 40 * block_size * dcp, (45,), generator=gen)
        slots[::7] = -1
        slots[5] = 3 * 2**31 + 17  # past int32: virtual block id arithmetic must stay int64
        seen = torch.zeros_like(slots)
        for rank in range(dcp):
            got = local_slot_mapping_triton(slots, cp=dcp, rank=rank, interleave=interleave, block_size=block_size, block=16,
                                            num_programs=2)
            want = layout.local_slot_mapping(slots, cp=dcp, rank=rank, interleave=interleave, block_size=block_size)
            assert got.dtype == torch.int64
            assert torch.equal(got, want), (dcp, interleave, rank)
            seen += got >= 0
        assert torch.equal(seen, (slots >= 0).long())  # every token stored on exactly one rank
    s32 = torch.tensor([-1, 0, 5, 17, 63], dtype=torch.int32)
    got32 = local_slot_mapping_triton(s32, cp=dcp, rank=dcp - 1, interleave=2, block_size=block_size)
    assert got32.dtype == torch.int32
    assert torch.equal(got32, layout.local_slot_mapping(s32, cp=dcp, rank=dcp - 1, interleave=2, block_size=block_size))


# ----------------------------------------------------------------------------- fallback


# A kernel module decorated outside interpreter mode, run on CPU tensors once triton.language
# is interpreted: `kernel_for` builds interpreted twins, whose jitted helpers (the shared
# LSE merge of core/attention_tile.py, the online-softmax step) must be twinned too.
_TWIN_SCRIPT = """
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
import triton.language  # noqa: F401  (decorated in interpreter mode)
del os.environ["TRITON_INTERPRET"]
from triton.runtime.jit import JITFunction
from cp_compile.ops.merge import reference as mref
from cp_compile.ops.merge.triton_merge import _merge_partials_kernel, lse_rescale_triton, merge_partials_triton
from cp_compile.ops.paged import reference as pref
from cp_compile.ops.paged.triton_decode import paged_attention_with_lse_triton
assert isinstance(_merge_partials_kernel, JITFunction), type(_merge_partials_kernel)  # not interpreted: a twin runs
os.environ["TRITON_INTERPRET"] = "1"  # set again at launch (triton 3.9's gluon asserts it when first imported)
g = torch.Generator().manual_seed(3)
outs, lses = torch.randn(3, 4, 2, 8, generator=g), torch.randn(3, 4, 2, generator=g)
lses[0, 1, 0] = float("-inf")
lse_out = torch.empty(4, 2)
got = merge_partials_triton(outs, lses, lse_out=lse_out)
want, want_lse = mref.merge_partials(outs, lses), torch.logsumexp(lses, 0)
torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(lse_out, want_lse, atol=1e-5, rtol=1e-5)
summed = sum(lse_rescale_triton(outs[n], lses[n], lses) for n in range(3))
torch.testing.assert_close(summed, want, atol=1e-5, rtol=1e-5)
q, kv = torch.randn(2, 4, 16, generator=g), torch.randn(6, 4, 1, 16, generator=g)
bt, qsl, kl = torch.arange(6, dtype=torch.int32).view(2, 3), torch.arange(3, dtype=torch.int32), torch.tensor([9, 12], dtype=torch.int32)
o, l = paged_attention_with_lse_triton(q, kv, kv, bt, qsl, kl, 0.25, num_splits=3)
ro, rl = pref.paged_attention_with_lse(q, kv, kv, bt, qsl, kl, 0.25)
torch.testing.assert_close(o, ro, atol=1e-5, rtol=1e-5)
torch.testing.assert_close(l, rl, atol=1e-5, rtol=1e-5)
print("TWIN OK")
"""


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_interpreted_twin_runs_jitted_helpers() -> None:
    """Kernels decorated without TRITON_INTERPRET, launched on CPU tensors after
    triton.language was imported with it: their twins call the shared @triton.jit helpers
    (the LSE merge, the online softmax) as interpreted functions too, and the DCP merge,
    the LSE rescale and a split decode match the references (a fresh interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _TWIN_SCRIPT], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "TWIN OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(IN_PROCESS or os.environ.get(_CHILD_ENV) == "1",
                    reason="checked in-process under the interpreter")
def test_kernels_in_fresh_interpreter() -> None:
    """Triton was imported here without TRITON_INTERPRET=1: rerun this file in a fresh
    interpreter where it is set before the first triton import."""
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_ENV: "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    summary = proc.stdout.strip().splitlines()[-1]
    assert " passed" in summary, proc.stdout[-2000:]  # not an all-skipped run
