"""Split-KV sparse MLA and lightning indexer (issue 36, docs/decisions.md 58) against the
torch references, under Triton's interpreter on CPU.

Sparse MLA cuts each row's selected-token list into `num_splits` ranges, one work item
each writing an fp32 partial, and `triton_split_merge` merges them by LSE; the indexer
cuts the key range (no merge: each score belongs to one split). Edge cases: splits that
end mid-tile, splits past the list (empty), ranges of -1 only, one selected token, rows
with different counts, padding rows; fp32 1e-5, bf16 2e-2. Pages no request owns hold
NaN (a split that read one would poison its row).

TRITON_INTERPRET handling as in test_kernels.py: set here when this file is the first
to import triton on a machine without CUDA, otherwise one test reruns the file in a
fresh interpreter with it set.
"""

from __future__ import annotations

import os
import sys

import torch

_CHILD_ENV = "CP_COMPILE_SPARSE_SPLIT_TESTS_CHILD"
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from cp_compile.ops.core.launcher import triton_available  # noqa: E402
from cp_compile.ops.merge import reference as merge_reference  # noqa: E402
from cp_compile.ops.sparse import reference as sparse_reference  # noqa: E402

assert triton_available(), "triton is not installed: pip install -e '.[test]'"

from cp_compile.ops.core.triton_common import capture_launches, interpreter_active, planning_for  # noqa: E402
from cp_compile.ops.sparse.triton_indexer import index_scores_triton, indexer_topk_rows  # noqa: E402
from cp_compile.ops.sparse.triton_sparse_mla import sparse_mla_rows_triton  # noqa: E402
from cp_compile.ops.sparse.triton_split_merge import merge_splits_triton  # noqa: E402

IN_PROCESS = interpreter_active()
interp = pytest.mark.skipif(not IN_PROCESS, reason="triton imported without TRITON_INTERPRET=1: "
                            "covered by test_sparse_split_in_fresh_interpreter")
NAN = float("nan")


def _close(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert not bool(torch.isnan(got).any()), f"{name}: NaN"
    assert bool((torch.isinf(got) == torch.isinf(want)).all()), f"{name}: -inf pattern differs"
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- sparse MLA


def mla_case(gen: torch.Generator, *, valid: list[int], K: int, H: int, L: int = 40, R: int = 12, BS: int = 4,
             width: int = 12, pad_rows: int = 0) -> tuple:
    """One row per request with valid[b] distinct selected positions (random order) then
    -1 up to K, plus `pad_rows` padding rows (req -1); page 0 finite (skipped entries
    read it in the reference), every page outside the table NaN."""
    B = len(valid)
    NB = B * width + 3
    pages = (torch.randperm(NB - 1, generator=gen)[: B * width] + 1).view(B, width).to(torch.int32)
    cache = torch.full((NB, BS, L + R), NAN)
    cache[0] = torch.randn(BS, L + R, generator=gen)
    cache[pages.long()] = torch.randn(B, width, BS, L + R, generator=gen)
    idx = torch.full((B + pad_rows, K), -1, dtype=torch.int32)
    for b, n in enumerate(valid):
        idx[b, :n] = torch.randperm(width * BS, generator=gen)[:n].to(torch.int32)
    T = B + pad_rows
    req = torch.tensor(list(range(B)) + [-1] * pad_rows, dtype=torch.int32)
    qn, qp = torch.randn(T, H, L, generator=gen), torch.randn(T, H, R, generator=gen)
    return qn, qp, cache, pages, req, idx, 0.2


def check_mla(name: str, case: tuple, tol: float = 1e-5, dtype: torch.dtype = torch.float32,
              **kw) -> tuple[torch.Tensor, torch.Tensor]:
    qn, qp, cache, bt, req, idx, scale = case
    out, lse = sparse_mla_rows_triton(qn.to(dtype), qp.to(dtype), cache.to(dtype), bt, req, idx, scale, **kw)
    want_out, want_lse = sparse_reference.sparse_attention_rows_with_lse(
        torch.cat([qn.to(dtype), qp.to(dtype)], -1).float(), cache.to(dtype).float(), bt, req, idx, qn.shape[-1],
        scale)
    assert out.dtype == dtype
    _close(f"{name} out", out, want_out, tol)
    _close(f"{name} lse", lse, want_lse, tol)
    return out, lse


def _splits(fn, *args, **kw) -> tuple[int, list[str]]:
    with capture_launches() as launches:
        fn(*args, **kw)
    return launches[0].args[12 if fn is sparse_mla_rows_triton else 8], [lc.kernel.fn.__name__ for lc in launches]


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_sparse_mla_split_ends_mid_tile(use_dot: bool) -> None:
    """40 selected entries in 3 splits of 14: both boundaries inside a 16 (dot) / 8 index
    tile, the last split short (12); -1 entries inside the lists, not only at their tail."""
    gen = torch.Generator().manual_seed(30)
    case = mla_case(gen, valid=[40, 33, 20], K=40, H=16 if use_dot else 5)
    case[5][0, 3:7] = -1  # skipped entries in the middle of a full list
    n, kernels = _splits(sparse_mla_rows_triton, *case, num_splits=3, use_dot=use_dot)
    assert n == 3 and kernels == ["_sparse_mla_kernel", "_sparse_split_merge_kernel"]
    kw = dict(block_h=16, block_n=16) if use_dot else {}
    check_mla("mid-tile", case, num_splits=3, use_dot=use_dot, **kw)


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_sparse_mla_split_empty_splits(use_dot: bool) -> None:
    """10 entries in 8 splits of 2: splits 5-7 lie past the list (no tile at all); a row
    of -1 only (every split runs tiles and finds nothing), a row of 3 (splits 2-7 hold
    only -1) and a padding row: out 0 and lse -inf where nothing is selected."""
    gen = torch.Generator().manual_seed(31)
    case = mla_case(gen, valid=[10, 0, 3], K=10, H=4, pad_rows=1)
    kw = dict(block_h=16, block_n=16) if use_dot else {}
    out, lse = check_mla("empty splits", case, num_splits=8, use_dot=use_dot, **kw)
    assert bool((out[1] == 0).all()) and bool(torch.isneginf(lse[1]).all())
    assert bool((out[3] == 0).all()) and bool(torch.isneginf(lse[3]).all())


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_sparse_mla_split_one_selected_token(use_dot: bool) -> None:
    """One valid entry per row, at list positions 0, 7 and 15 of 16 (so in split 0, 1 and
    3 of 4): out is that latent row's first L columns, lse that single score."""
    gen = torch.Generator().manual_seed(32)
    qn, qp, cache, bt, req, idx, scale = mla_case(gen, valid=[0, 0, 0], K=16, H=3)
    for b, at in enumerate((0, 7, 15)):
        idx[b, at] = 5 + b
    kw = dict(block_h=16, block_n=16) if use_dot else {}
    out, lse = check_mla("one token", (qn, qp, cache, bt, req, idx, scale), num_splits=4, use_dot=use_dot, **kw)
    rows = torch.stack([cache[int(bt[b, (5 + b) // 4]), (5 + b) % 4] for b in range(3)])  # [3, L+R]
    torch.testing.assert_close(out, rows[:, None, :40].expand_as(out))
    torch.testing.assert_close(lse, torch.einsum("thd,td->th", torch.cat([qn, qp], -1), rows) * scale)


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_sparse_mla_split_default_count_mixed_rows(use_dot: bool) -> None:
    """The default split count (kv_splits over the list width and CPU_MAX_PROGRAMS = 32
    cores): 64 entries, 20 heads in two head blocks (the second mostly masked on the dot
    path), rows of 64, 30, 1 and 0 valid entries: 8 items -> 4 splits of 16, holding
    different counts per row, several nothing."""
    gen = torch.Generator().manual_seed(33)
    case = mla_case(gen, valid=[64, 30, 1, 0], K=64, H=20, L=24, R=8, width=20)
    kw = dict(block_h=16, block_n=16) if use_dot else dict(block_n=16)
    n, _ = _splits(sparse_mla_rows_triton, *case, use_dot=use_dot, **kw)
    assert n == 4
    check_mla("default splits", case, use_dot=use_dot, **kw)


@interp
def test_sparse_mla_split_bf16() -> None:
    """bf16 q / cache, fp32 partials, bf16 out (broadcast product: the interpreter's tl.dot
    misreads bf16), 2e-2 against the fp32 reference on the same rounded values."""
    gen = torch.Generator().manual_seed(34)
    case = mla_case(gen, valid=[30, 9, 0], K=30, H=4)
    check_mla("bf16", case, tol=2e-2, dtype=torch.bfloat16, num_splits=5)


@interp
def test_sparse_split_merge_is_strict() -> None:
    """The merge stage alone against ops/merge's oracle (decision 47): an -inf split with
    garbage (NaN) out weighs 0 and is not read; an all-empty row is 0 / -inf; a NaN or
    +inf split LSE makes its row NaN; Dv 40 (one masked column block)."""
    gen = torch.Generator().manual_seed(35)
    S, T, H, Dv = 4, 3, 2, 40
    po, pl = torch.randn(S, T, H, Dv, generator=gen), torch.randn(S, T, H, generator=gen)
    pl[1, 0, 0] = float("-inf")
    po[1, 0, 0] = NAN  # an empty split's garbage
    pl[:, 1, 1] = float("-inf")  # all empty
    pl[2, 2, 0] = NAN
    pl[3, 2, 1] = float("inf")
    out, lse = torch.empty(T, H, Dv), torch.empty(T, H)
    merge_splits_triton(po, pl, out, lse)
    want = merge_reference.merge_partials(po, pl)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert bool(torch.isnan(out[2]).all()) and bool(torch.isnan(lse[2]).all())
    assert bool((out[1, 1] == 0).all()) and bool(torch.isneginf(lse[1, 1]))
    ok = torch.isfinite(pl).all(0) | (pl == float("-inf")).any(0)
    ref_lse = torch.logsumexp(pl, 0)
    torch.testing.assert_close(lse[:2], ref_lse[:2], atol=1e-5, rtol=1e-5)
    assert bool(ok[:2].all())


# ----------------------------------------------------------------------------- lightning indexer


def indexer_case(gen: torch.Generator, *, kv_lens: list[int], Hi: int = 16, Di: int = 16, BS: int = 4,
                 width: int = 12, integer: bool = False) -> tuple:
    """Rows of request 0 / 1 alternately with the given causal lengths (0 = a row with no
    key), pages outside the table NaN; integer values make the scores exact (ties)."""
    T = len(kv_lens)
    NB = 2 * width + 2
    pages = torch.randperm(NB, generator=gen)[: 2 * width].view(2, width).to(torch.int32)

    def draw(*shape):
        return (torch.randint(-2, 3, shape, generator=gen).float() if integer
                else torch.randn(*shape, generator=gen))

    cache = torch.full((NB, BS, Di), NAN)
    cache[pages.long()] = draw(2, width, BS, Di)
    req = torch.tensor([t % 2 for t in range(T)], dtype=torch.int32)
    return draw(T, Hi, Di), cache, draw(T, Hi), pages, req, torch.tensor(kv_lens, dtype=torch.int32)


def scores_oracle(q, cache, w, bt, req, kv_lens) -> torch.Tensor:
    S = bt.shape[1] * cache.shape[1]
    want = torch.full((q.shape[0], S), float("-inf"))
    for t in range(q.shape[0]):
        n = int(kv_lens[t]) if int(req[t]) >= 0 else 0
        if n:
            keys = cache[bt[int(req[t])].long()].reshape(S, -1)[:n].float()
            want[t, :n] = sparse_reference.lightning_index_scores(q[t:t + 1].float(), keys, w[t:t + 1].float())[0]
    return want


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_indexer_split_ends_mid_tile(use_dot: bool) -> None:
    """S = 48 keys in 5 splits of 10: boundaries inside 16 (dot) / 8 key tiles; rows whose
    kv_len ends inside a split (13, 31), at the table (48), at one key, at none, and a
    padding row: scores equal the oracle's, -inf past each row's keys, nothing NaN."""
    gen = torch.Generator().manual_seed(40)
    q, cache, w, bt, req, kv = indexer_case(gen, kv_lens=[13, 48, 1, 0, 31, 20])
    req[5] = -1
    kw = dict(block_n=16) if use_dot else dict(block_n=8)
    assert _splits(index_scores_triton, q, cache, w, bt, req, kv, num_splits=5, use_dot=use_dot, **kw)[0] == 5
    got = index_scores_triton(q, cache, w, bt, req, kv, num_splits=5, use_dot=use_dot, **kw)
    _close("indexer mid-tile", got, scores_oracle(q, cache, w, bt, req, kv), 1e-5)


@interp
@pytest.mark.parametrize("use_dot", [False, True])
def test_indexer_split_default_count_topk_exact(use_dot: bool) -> None:
    """The default split count (`kv_splits` over S = 160 keys and 32 cores, splits of >= 64
    keys): 3 splits of 64, the last holding 32; on integer inputs (exact scores, many ties)
    the top-k equals the reference's stable order, -1 padded, with most splits past the
    short rows' keys."""
    gen = torch.Generator().manual_seed(41)
    q, cache, w, bt, req, kv = indexer_case(gen, kv_lens=[160, 5, 1, 90], width=40, integer=True)
    kw = dict(block_n=16, use_dot=use_dot)
    with capture_launches() as launches:
        index_scores_triton(q, cache, w, bt, req, kv, **kw)
    assert launches[0].args[8:10] == (3, 64)
    for topk in (7, 200):
        got = indexer_topk_rows(q, cache, w, bt, req, kv, topk, **kw)
        assert torch.equal(got, sparse_reference.lightning_indexer_topk_rows(q, cache, w, bt, req, kv, topk))


@interp
def test_indexer_split_bf16() -> None:
    """bf16 q / keys / weights, fp32 scores, 2e-2 (relative to the scores' scale) against
    the oracle on the same rounded values; 3 splits of 16 keys."""
    gen = torch.Generator().manual_seed(42)
    q, cache, w, bt, req, kv = indexer_case(gen, kv_lens=[40, 17, 48])
    q, cache, w = q.bfloat16(), cache.bfloat16(), w.bfloat16()
    got = index_scores_triton(q, cache, w, bt, req, kv, num_splits=3)
    want = scores_oracle(q, cache, w, bt, req, kv)
    _close("indexer bf16", got, want, 2e-2 * float(want[torch.isfinite(want)].abs().max()))


@interp
def test_sparse_split_one_split_on_a_persistent_grid() -> None:
    """The NPU's launch form: sparse MLA with one split (no partials, no merge) and the
    indexer with one 8-key tile per item, on a persistent grid of 3 programs that each
    stride over several items (the interpreter otherwise launches the split form)."""
    gen = torch.Generator().manual_seed(36)
    case = mla_case(gen, valid=[20, 0, 7], K=20, H=3, pad_rows=1)
    n, kernels = _splits(sparse_mla_rows_triton, *case, num_splits=1, num_programs=3)
    assert n == 1 and kernels == ["_sparse_mla_kernel"]
    check_mla("one split", case, num_splits=1, num_programs=3)
    q, cache, w, bt, req, kv = indexer_case(gen, kv_lens=[13, 48, 0])
    got = index_scores_triton(q, cache, w, bt, req, kv, num_splits=6, block_n=8, num_programs=3)
    _close("indexer tiles", got, scores_oracle(q, cache, w, bt, req, kv), 1e-5)


# ----------------------------------------------------------------------------- launch plan (no interpreter needed)


def test_sparse_split_counts_fill_the_waves_on_an_h200() -> None:
    """What the launchers plan for CUDA with 132 SMs (captured, nothing runs): sparse MLA
    at batch 8, 16 heads, top-2048 splits into 32 splits of 64 indices (1.94 waves: 2 rounds,
    where 43 splits of 48 would take 3), the indexer at batch 1, 64 x 128 heads, 32k keys
    into 1.94; tl.dot with all 16 heads x 32 indices in one tile at 8
    warps (the spill-free CUDA tile); the NPU's sparse MLA launch stays unsplit on its core
    count, 16 indices a tile, no num_warps."""
    bt = torch.zeros(8, 512, dtype=torch.int32)
    idx = torch.zeros(8, 2048, dtype=torch.int32)
    qn, qp = torch.empty(8, 16, 512, dtype=torch.bfloat16), torch.empty(8, 16, 64, dtype=torch.bfloat16)
    cache = torch.empty(1, 64, 576, dtype=torch.bfloat16).expand(4096, 64, 576)
    req = torch.arange(8, dtype=torch.int32)
    with capture_launches() as launches, planning_for("cuda", 132):
        sparse_mla_rows_triton(qn, qp, cache, bt, req, idx, 0.1)
    att, merge = launches
    assert att.grid[0] == 8 * 32 and att.kwargs["BLOCK_H"] == 16 and att.kwargs["USE_DOT"] is True
    # The spill-free CUDA tile (docs/kernels_aot.md production table): 32 indices, 8 warps.
    assert att.kwargs["BLOCK_N"] == 32 and att.kwargs["num_warps"] == 8
    assert merge.kernel.fn.__name__ == "_sparse_split_merge_kernel"
    with capture_launches() as launches, planning_for("npu", 24):
        sparse_mla_rows_triton(qn, qp, cache, bt, req, idx, 0.1)
    assert len(launches) == 1 and launches[0].args[12] == 1 and launches[0].grid[0] <= 24
    # The NPU's tile: 16 indices, no num_warps (not a Triton-Ascend option).
    assert launches[0].kwargs["BLOCK_N"] == 16 and "num_warps" not in launches[0].kwargs
    index = torch.empty(1, 64, 128, dtype=torch.bfloat16).expand(512, 64, 128)
    with capture_launches() as launches, planning_for("cuda", 132):
        index_scores_triton(torch.empty(1, 64, 128, dtype=torch.bfloat16), index, torch.empty(1, 64), bt[:1], req[:1],
                            torch.full((1,), 32768, dtype=torch.int32))
    # 256 splits of 128 keys: the 264 the waves want, rounded to whole 16-key lengths
    # (no merge: the count is chosen for the fewest rounds, docs/kernels.md).
    assert launches[0].args[8:10] == (256, 128) and launches[0].grid[0] == 256
    assert launches[0].kwargs["HI_PAD"] == 64 and launches[0].kwargs["USE_DOT"] is True


@pytest.mark.skipif(IN_PROCESS or os.environ.get(_CHILD_ENV) == "1",
                    reason="ran in-process under the interpreter")
def test_sparse_split_in_fresh_interpreter() -> None:
    """Triton was imported here without TRITON_INTERPRET=1: rerun this file in a fresh
    interpreter where it is set before the first triton import."""
    env = {**os.environ, "TRITON_INTERPRET": "1", _CHILD_ENV: "1"}
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p",
                           "no:cacheprovider"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout.strip().splitlines()[-1], proc.stdout[-2000:]
