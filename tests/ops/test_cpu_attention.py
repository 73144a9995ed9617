"""The CPU kernels of the paged attention ops (ops/paged/cpu.py) against their references.

The op tests (test_attention.py, test_dcp_ops.py) check the ops against independent
dense math; here the kernel is held to `paged_reference.paged_attention_with_lse` on what
only the kernel has: the in-place (strided view) path and the gathered path, chunk
and tile boundaries (forced small), masks cut inside a chunk, padded tokens, a cache
dtype other than q's, Dv != D, and MLA's values read from the key pages. A broken merge
must be caught (test_a_broken_merge_is_caught).
Decode and verify groups (few query rows per KV head, fp32, head dims a multiple of 8) run
the C kernel of ops/paged/cpu_decode.c; the `kernel` parameter runs a case through it (asserted to
have run) and through the pure-torch kernel (`CP_COMPILE_CPU_DECODE=torch`).
The second half poisons every slot no request may read with NaN / inf (what a rolled-back
draft or a torch.empty cache holds): nothing outside [0, kv_len) may reach a result
(docs/decisions.md 41).
"""

from __future__ import annotations

import pytest
import torch

import cp_compile.ops  # noqa: F401  (registers torch.ops.cp.* and the CPU kernels)
from cp_compile.ops.paged import cpu as cpu_attention, cpu_decode
from cp_compile.ops.core import paged_cache
from cp_compile.ops.paged import reference as paged_reference
from cp_compile.ops.core import registry
from cp_compile.ops.core.layout import request_index

SCALE = 0.3
KERNELS = ["c", "torch"]


def _has_avx2() -> bool:
    try:
        return " avx2 " in open("/proc/cpuinfo").read().replace("\n", " ") + " "
    except OSError:
        return False


def use_kernel(kernel: str, monkeypatch) -> list[bool]:
    """Route decode / verify groups to the C kernel ("c": returns its call log, one entry per
    group, True when it ran) or to the pure-torch kernel ("torch")."""
    if kernel == "torch":
        monkeypatch.setenv("CP_COMPILE_CPU_DECODE", "torch")
        return []
    if not _has_avx2():
        pytest.skip("this CPU has no AVX2: the C decode kernel never runs here (the torch kernel does)")
    monkeypatch.delenv("CP_COMPILE_CPU_DECODE", raising=False)
    assert cpu_decode.library() is not None, "the C decode kernel did not build (see the RuntimeWarning)"
    calls: list[bool] = []
    attend = cpu_decode.attend
    monkeypatch.setattr(cpu_decode, "attend", lambda *a, **kw: (lambda r: calls.append(r is not None) or r)(attend(*a, **kw)))
    return calls


def make_case(ctx: list[int], new: list[int], *, bs: int = 4, hq: int = 4, hkv: int = 2, d: int = 8, dv: int = 8,
              dtype: torch.dtype = torch.float32, q_dtype: torch.dtype | None = None, affine: bool = False,
              pad: int = 0, seed: int = 0):
    """A paged step: requests with `ctx` cached and `new` query tokens (token i of b sees ctx + i + 1 keys)."""
    g = torch.Generator().manual_seed(seed)
    B = len(ctx)
    nb = max((c + n + bs - 1) // bs for c, n in zip(ctx, new)) + 1
    NB = B * nb + 3
    ids = torch.arange(B * nb) + 1 if affine else torch.randperm(NB, generator=g)[: B * nb]
    table = ids.view(B, nb).int()
    k_cache = torch.randn(NB, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(NB, bs, hkv, dv, generator=g).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    kv_lens = [c + i + 1 for c, n in zip(ctx, new) for i in range(n)] + [0] * pad
    q = torch.randn(len(kv_lens), hq, d, generator=g).to(q_dtype or dtype)
    return q, k_cache, v_cache, table, qsl, torch.tensor(kv_lens, dtype=torch.int32)


def assert_close_to_reference(args, tol: float = 1e-5, lse_tol: float = 1e-5) -> None:
    out_r, lse_r = paged_reference.paged_attention_with_lse(*args, SCALE)
    out, lse = cpu_attention.paged_attention_lse(*args, SCALE)
    assert out.dtype == out_r.dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isfinite(lse), torch.isfinite(lse_r)), "empty rows (lse -inf) differ"
    fin = torch.isfinite(lse_r)
    torch.testing.assert_close(lse[fin], lse_r[fin], atol=lse_tol, rtol=lse_tol)
    torch.testing.assert_close(out.float(), out_r.float(), atol=tol, rtol=tol)


CASES = {
    "decode": ([5, 12, 3], [1, 1, 1]),
    "prefill": ([0, 0], [7, 3]),
    "chunked_prefill": ([9, 3], [4, 6]),
    "mixed": ([0, 10, 7, 4], [6, 1, 1, 3]),
    "multi_query_decode": ([8, 13], [3, 2]),
    "long_decode": ([300, 500, 70], [1, 1, 1]),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("affine", [False, True], ids=["gathered", "in_place"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name: str, affine: bool, kernel: str, monkeypatch) -> None:
    # Small chunks and tiles: every case crosses chunk boundaries and cuts masks inside one
    # (the C kernel's blocks are 32 keys: the long cases cross them, the short ones cut one).
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", 8192)
    monkeypatch.setattr(cpu_attention, "VIEW_CHUNK_TOKENS", 32)
    monkeypatch.setattr(cpu_attention, "ROWS_PER_TILE", 16)
    calls = use_kernel(kernel, monkeypatch)
    ctx, new = CASES[name]
    assert_close_to_reference(make_case(ctx, new, affine=affine, pad=2))
    assert kernel == "torch" or (calls and all(calls)), "the C kernel did not run"


def test_c_kernel_at_the_real_decode_shape(monkeypatch) -> None:
    """GQA 8 q / 1 KV heads x 128, block 16, a shuffled table, ragged lengths (a block and a
    page cut inside), and several query tokens per request (a verify step, 32 rows)."""
    calls = use_kernel("c", monkeypatch)
    for ctx, new in (([700, 513, 64, 33], [1, 1, 1, 1]), ([95, 300], [4, 3])):
        assert_close_to_reference(make_case(ctx, new, bs=16, hq=8, hkv=1, d=128, dv=128, pad=1, seed=5))
    assert len(calls) == 2 and all(calls)  # one group per step (4 and 3 tokens: one power-of-two class)


def test_c_kernel_refuses_a_page_outside_the_cache(monkeypatch) -> None:
    use_kernel("c", monkeypatch)
    q, k_cache, v_cache, table, qsl, kv_lens = make_case([5, 12, 3], [1, 1, 1])
    table[1, 2] = k_cache.shape[0]
    with pytest.raises(IndexError, match="block_table: a request's page id is outside the cache"):
        cpu_attention.paged_attention_lse(q, k_cache, v_cache, table, qsl, kv_lens, SCALE)


def test_in_place_path_is_taken_only_for_an_affine_table() -> None:
    _, k_cache, _, table, _, kv_lens = make_case([20, 20, 20], [1, 1, 1], affine=True)
    need = torch.full((3,), 6)
    view = cpu_attention._strided_view(k_cache, table.long(), need)
    assert view is not None and view.data_ptr() == k_cache[table[0, 0]].data_ptr()
    torch.testing.assert_close(view[1, :24], paged_cache.gather_request_pages(k_cache, table[1], 24), rtol=0, atol=0)
    shuffled = table.clone()
    shuffled[1, 2], shuffled[1, 3] = table[1, 3], table[1, 2]
    assert cpu_attention._strided_view(k_cache, shuffled.long(), need) is None
    # entries past a request's pages do not matter; running off the cache's end does
    assert cpu_attention._strided_view(k_cache, table.long(), torch.tensor([6, 6, 3])) is not None
    assert cpu_attention._strided_view(k_cache, (table + k_cache.shape[0] - 18).long(), need) is None


@pytest.mark.parametrize("kind", ["dv_larger", "dv_smaller", "bf16_cache_fp32_q", "bf16"])
def test_dtypes_and_head_dims(kind: str) -> None:
    opts = {"dv_larger": dict(dv=12), "dv_smaller": dict(dv=5),
            "bf16_cache_fp32_q": dict(dtype=torch.bfloat16, q_dtype=torch.float32),
            "bf16": dict(dtype=torch.bfloat16)}[kind]
    # bf16 q: both compute in fp32 and round the output to bf16 once (one bf16 ulp apart at most);
    # the fp32 LSE stays within the GE check's fp32 tolerance (1e-5), which torch's bf16 flash misses.
    tol = 2e-2 if kind == "bf16" else 1e-5
    assert_close_to_reference(make_case([0, 10, 7, 4], [6, 1, 1, 3], pad=1, **opts), tol=tol, lse_tol=1e-5)


def test_mla_values_are_read_from_the_key_pages() -> None:
    g = torch.Generator().manual_seed(1)
    q, kv_cache, _, table, qsl, kv_lens = make_case([9, 0, 30], [1, 5, 2], hq=4, hkv=1, d=12)
    kv_cache = kv_cache[:, :, 0]  # [NB, BS, L+R], L = 8, R = 4
    q_nope, q_pe = q[..., :8].contiguous(), torch.randn(q.shape[0], 4, 4, generator=g)
    assert cpu_attention._v_is_k_prefix(kv_cache.unsqueeze(2), kv_cache[..., :8].unsqueeze(2))
    ref = paged_reference.mla_attention_with_lse(q_nope, q_pe, kv_cache, table, qsl, kv_lens, SCALE)
    got = cpu_attention.mla_attention_lse(q_nope, q_pe, kv_cache, table, qsl, kv_lens, SCALE)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    fin = torch.isfinite(ref[1])
    torch.testing.assert_close(got[1][fin], ref[1][fin], atol=1e-5, rtol=1e-5)


def test_ops_dispatch_to_the_cpu_kernels(monkeypatch) -> None:
    """torch.ops.cp.* on CPU run these kernels (OpDecl.cpu), not their bodies: every op's call
    reaches the kernel's group loop (counted), and gives the kernel's result."""
    regs = registry.register_device_kernels()
    for op in ("gqa_paged_attention", "mla_attention", "paged_attention_lse", "mla_partial_attention"):
        assert f"cp::{op}@cpu" in regs
    calls = []
    group = cpu_attention._attend_group
    monkeypatch.setattr(cpu_attention, "_attend_group", lambda *a, **kw: calls.append(1) or group(*a, **kw))
    args = make_case([5, 12], [2, 1])
    out, lse = torch.ops.cp.paged_attention_lse(*args, SCALE)
    assert len(calls) == 2  # two token-count classes (2 tokens, 1 token)
    monkeypatch.setattr(cpu_attention, "_attend_group", group)
    k_out, k_lse = cpu_attention.paged_attention_lse(*args, SCALE)
    assert torch.equal(out, k_out) and torch.equal(lse, k_lse)


def test_gqa_op_on_a_poisoned_cache_after_rollback(monkeypatch) -> None:
    """The whole op (cache write, then attention) as spec decoding drives it: a verify step writes
    its 4 draft tokens into slots that held rejected drafts (NaN), and every slot past seq_len is
    NaN. The dispatched CPU kernel equals the op's body on a clean cache."""
    from cp_compile.ops.paged.ops import _gqa_step
    calls = []
    group = cpu_attention._attend_group
    monkeypatch.setattr(cpu_attention, "_attend_group", lambda *a, **kw: calls.append(1) or group(*a, **kw))
    g = torch.Generator().manual_seed(4)
    bs, hq, hkv, d, NB = 4, 4, 2, 8, 12
    table = torch.tensor([[7, 2, 9, 11], [3, 8, 0, 11]], dtype=torch.int32)  # pages after reuse
    seq_lens = torch.tensor([10, 3], dtype=torch.int32)  # request 0: context 6 + 4 drafts; request 1: decode
    qsl = torch.tensor([0, 4, 5], dtype=torch.int32)
    slots = torch.tensor([2 * bs + 2, 2 * bs + 3, 9 * bs + 0, 9 * bs + 1, 3 * bs + 2, -1])  # positions 6..9; 2; pad
    q, k, v = (torch.randn(6, h, d, generator=g) for h in (hq, hkv, hkv))
    k_cache, v_cache = torch.randn(NB, bs, hkv, d, generator=g), torch.randn(NB, bs, hkv, d, generator=g)
    context = readable_slots(NB * bs, bs, table, torch.tensor([6, 2]))
    bad_k, bad_v = k_cache.clone(), v_cache.clone()
    for c in (bad_k, bad_v):
        c.view(NB * bs, hkv, d)[~context] = float("nan")  # the draft slots too: the op writes them first
    meta = (slots, table, seq_lens, qsl, SCALE)
    got = torch.ops.cp.gqa_paged_attention(q, k, v, bad_k, bad_v, *meta)
    assert calls, "gqa_paged_attention did not run the CPU kernel"
    ref = _gqa_step(paged_reference.paged_attention_with_lse, q, k, v, k_cache, v_cache, *meta)  # the body, not dispatched
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_a_broken_merge_is_caught(monkeypatch) -> None:
    """The comparison above fails when the torch kernel drops every chunk after the first."""
    use_kernel("torch", monkeypatch)
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", 8192)
    monkeypatch.setattr(cpu_attention, "_merge", lambda acc, lse, out, l: (acc, lse))
    with pytest.raises(AssertionError):
        assert_close_to_reference(make_case([300, 500, 70], [1, 1, 1]))


# ----------------------------------------------------------------------------- garbage outside [0, kv_len)
# A real engine allocates its caches with torch.empty and never clears a freed or rolled-back
# slot (spec decoding's rejected drafts; tests/spec_decode writes NaN there on purpose). No
# slot a request may not read can reach a result: not one past the largest kv_len of the
# request's tokens (inside its last page, or in pages past it), not an unused block-table
# entry, not a page of a request whose shard on this rank is empty (kv_len 0).
POISONS = {"nan": float("nan"), "inf": float("inf")}
POISON_RUNS = [("default", "nan"), ("small", "nan"), ("small", "inf")]  # chunk sizes as shipped / forced small
# (kernel, chunks, poison): chunk sizes are the torch kernel's (its chunk and tile boundaries are
# what the forced-small runs cut); the C kernel's blocks are fixed. The torch kernel at default
# chunks is no longer the default decode path, so it keeps the two small-chunk runs only.
POISON_KERNEL_RUNS = [("c", "default", "nan"), ("c", "default", "inf")] + [("torch", c, p) for c, p in POISON_RUNS
                                                                          if c == "small"]


def prefix_lens(qsl: torch.Tensor, kv_lens: torch.Tensor, B: int) -> torch.Tensor:
    """[B] the readable prefix of each request: the largest kv_len of its tokens (0: none)."""
    req = request_index(qsl, kv_lens.shape[0])
    return torch.stack([kv_lens[req == b].max() if (req == b).any() else torch.tensor(0) for b in range(B)]).long()


def readable_slots(n_slots: int, bs: int, table: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """[n_slots] bool: the slots of positions 0..lens[b]-1 of every request b."""
    keep = torch.zeros(n_slots, dtype=torch.bool)
    for b in range(table.shape[0]):
        pos = torch.arange(int(lens[b]))
        keep[table[b, pos // bs].long() * bs + pos % bs] = True
    return keep


def poisoned(args, value: float):
    """The case with every unreadable cache slot set to `value` and every block-table entry past a
    request's pages pointing at a stale page (a freed one, itself unreadable)."""
    q, k_cache, v_cache, table, qsl, kv_lens = args
    bs = k_cache.shape[1]
    lens = prefix_lens(qsl, kv_lens, table.shape[0])
    keep = readable_slots(k_cache.shape[0] * bs, bs, table, lens)
    stale_page = int(torch.nonzero(~keep.view(-1, bs).any(1)).max())
    need = (lens + bs - 1) // bs
    table = torch.where(torch.arange(table.shape[1])[None, :] < need[:, None], table, torch.full_like(table, stale_page))
    caches = []
    for c in (k_cache, v_cache):
        c = c.clone()
        c.view(-1, *c.shape[2:])[~keep] = value
        caches.append(c)
    assert (~keep).any() and not torch.isfinite(caches[0]).all()
    return q, caches[0], caches[1], table, qsl, kv_lens


def assert_garbage_is_harmless(args, value: float, tol: float = 1e-5) -> None:
    """Kernel and reference on the poisoned cache == the reference on the clean one."""
    out_c, lse_c = paged_reference.paged_attention_with_lse(*args, SCALE)
    bad = poisoned(args, value)
    for name, fn in (("reference", paged_reference.paged_attention_with_lse), ("kernel", cpu_attention.paged_attention_lse)):
        out, lse = fn(*bad, SCALE)
        assert torch.equal(torch.isfinite(lse), torch.isfinite(lse_c)), f"{name}: empty rows (lse -inf) differ"
        fin = torch.isfinite(lse_c)
        torch.testing.assert_close(lse[fin], lse_c[fin], atol=tol, rtol=tol, msg=lambda m: f"{name} lse: {m}")
        torch.testing.assert_close(out.float(), out_c.float(), atol=tol, rtol=tol, msg=lambda m: f"{name} out: {m}")


def small_chunks(monkeypatch) -> None:
    monkeypatch.setattr(cpu_attention, "CHUNK_BYTES", 8192)
    monkeypatch.setattr(cpu_attention, "VIEW_CHUNK_TOKENS", 32)
    monkeypatch.setattr(cpu_attention, "ROWS_PER_TILE", 16)


@pytest.mark.parametrize("kernel,chunks,poison", POISON_KERNEL_RUNS)
@pytest.mark.parametrize("affine", [False, True], ids=["gathered", "in_place"])
@pytest.mark.parametrize("name", list(CASES))
def test_garbage_past_kv_lens_is_never_read(name: str, affine: bool, kernel: str, chunks: str, poison: str,
                                            monkeypatch) -> None:
    calls = use_kernel(kernel, monkeypatch)
    if chunks == "small":
        small_chunks(monkeypatch)
    args = make_case(*CASES[name], affine=affine, pad=2)
    assert_garbage_is_harmless(args, POISONS[poison])
    assert kernel == "torch" or (calls and all(calls)), "the C kernel did not run"


def spec_decode_case(affine: bool, dtype: torch.dtype = torch.float32):
    """A verify step after rollbacks on a DCP rank (bs 4): request 0 verifies 4 tokens at context 6
    (kv_lens 7..10, its last page half stale), request 1's first token has no local key (kv_len 0,
    interleaved shard), request 2's shard is empty (kv_len 0, table row of freed pages), two padding
    tokens. Pages come from an allocator after reuse (not affine) unless `affine`."""
    g = torch.Generator().manual_seed(3)
    rows = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]] if affine else [[7, 2, 9, 12], [3, 8, 0, 12], [5, 11, 1, 12]]
    table = torch.tensor(rows, dtype=torch.int32)
    NB, bs, hq, hkv, d = 14, 4, 4, 2, 8
    k_cache = torch.randn(NB, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(NB, bs, hkv, d, generator=g).to(dtype)
    qsl = torch.tensor([0, 4, 8, 11], dtype=torch.int32)
    kv_lens = torch.tensor([7, 8, 9, 10, 0, 1, 1, 2, 0, 0, 0, 0, 0], dtype=torch.int32)
    q = torch.randn(kv_lens.shape[0], hq, d, generator=g).to(dtype)
    return q, k_cache, v_cache, table, qsl, kv_lens


@pytest.mark.parametrize("kernel,chunks,poison", POISON_KERNEL_RUNS)
@pytest.mark.parametrize("affine", [False, True], ids=["gathered", "in_place"])
def test_spec_decode_rollback_pattern(affine: bool, kernel: str, chunks: str, poison: str, monkeypatch) -> None:
    calls = use_kernel(kernel, monkeypatch)
    if chunks == "small":
        small_chunks(monkeypatch)
    args = spec_decode_case(affine)
    if affine:  # the in-place path is what runs here
        need = torch.tensor([3, 1, 0])
        assert cpu_attention._strided_view(args[1], args[3].long(), need) is not None
    assert_garbage_is_harmless(args, POISONS[poison])
    assert kernel == "torch" or (calls and all(calls)), "the C kernel did not run"


def test_garbage_bf16_cache() -> None:
    assert_garbage_is_harmless(spec_decode_case(False, torch.bfloat16), float("nan"), tol=2e-2)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("affine", [False, True], ids=["gathered", "in_place"])
def test_mla_garbage_past_kv_lens_is_never_read(affine: bool, kernel: str, monkeypatch) -> None:
    calls = use_kernel(kernel, monkeypatch)
    g = torch.Generator().manual_seed(1)
    L, R = 16, 8
    q, kv_cache, _, table, qsl, kv_lens = make_case([9, 0, 30], [1, 5, 2], hq=4, hkv=1, d=L + R, affine=affine)
    kv_cache = kv_cache[:, :, 0]  # [NB, BS, L+R]
    q_nope, q_pe = q[..., :L].contiguous(), torch.randn(q.shape[0], 4, R, generator=g)
    clean = paged_reference.mla_attention_with_lse(q_nope, q_pe, kv_cache, table, qsl, kv_lens, SCALE)
    _, bad, _, bad_table, _, _ = poisoned((q, kv_cache.unsqueeze(2), kv_cache.unsqueeze(2), table, qsl, kv_lens),
                                          float("nan"))
    for fn in (paged_reference.mla_attention_with_lse, cpu_attention.mla_attention_lse):
        out, lse = fn(q_nope, q_pe, bad[:, :, 0], bad_table, qsl, kv_lens, SCALE)
        torch.testing.assert_close(out, clean[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(torch.isfinite(lse), torch.isfinite(clean[1]))
    assert kernel == "torch" or (calls and all(calls)), "the C kernel did not run"
