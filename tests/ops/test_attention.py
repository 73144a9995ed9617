"""Single-device attention ops (`cp::*`, ops/paged/ops.py, ops/sparse/ops.py) against independent dense math.

The oracles here do not use the paged-cache helpers of ops/core/paged_cache.py: every
request's full K/V is built from scratch as a dense tensor (the cached prefix plus
this step's tokens) and attention is computed in fp64 with explicit loops, so a bug
shared by the op and reference.py cannot hide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import cp_compile.ops  # noqa: F401  (registers torch.ops.cp.*)
from cp_compile.ops.core import paged_cache
from cp_compile.ops.sparse import reference as sparse_reference
from cp_compile.testing.topk import assert_same_topk

cp = torch.ops.cp

# name -> (context lengths already cached, new tokens per request, padding tokens)
SCENARIOS: dict[str, tuple[list[int], list[int], int]] = {
    "decode": ([5, 12, 3], [1, 1, 1], 0),
    "prefill": ([0, 0], [7, 3], 0),
    "chunked_prefill": ([9, 3], [4, 6], 0),
    "mixed": ([0, 10, 7, 4], [6, 1, 1, 3], 0),
    "multi_query_decode": ([8, 13], [3, 2], 0),
    "padding": ([5, 0, 6], [1, 4, 2], 3),
}


# --------------------------------------------------------------------------- batch helpers


@dataclass
class Batch:
    ctx_lens: list[int]
    q_lens: list[int]
    seq_lens_list: list[int]
    block_size: int
    num_blocks: int
    block_table: torch.Tensor  # [B, nb] int32, -1 past each request's blocks
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens
    tok_req: list[int]  # request of each token, -1 for padding
    tok_pos: list[int]  # request-local position of each token, -1 for padding

    @property
    def num_tokens(self) -> int:
        return len(self.tok_req)

    def slot(self, b: int, p: int) -> int:
        return int(self.block_table[b, p // self.block_size]) * self.block_size + p % self.block_size


def make_batch(ctx_lens: list[int], q_lens: list[int], n_pad: int, block_size: int,
               gen: torch.Generator, spare_blocks: int = 3) -> Batch:
    """A tiny block allocator: each request gets distinct, randomly chosen block ids.

    Random ids make the block table non-contiguous, spare blocks hold garbage that
    must never be read, and -1 fills unused table entries so an over-read shows up.
    """
    seq = [c + q for c, q in zip(ctx_lens, q_lens)]
    nbs = [(s + block_size - 1) // block_size for s in seq]
    num_blocks = sum(nbs) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(nbs) + 1
    table = torch.full((len(seq), width), -1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(nbs):
        table[b, :n] = torch.tensor(perm[nxt:nxt + n], dtype=torch.int32)
        nxt += n
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    tok_req, tok_pos = [], []
    for b, (c, q) in enumerate(zip(ctx_lens, q_lens)):
        tok_req += [b] * q
        tok_pos += list(range(c, c + q))
    tok_req += [-1] * n_pad
    tok_pos += [-1] * n_pad
    batch = Batch(ctx_lens, q_lens, seq, block_size, num_blocks, table,
                  torch.tensor(seq, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                  torch.empty(0, dtype=torch.int64), tok_req, tok_pos)
    batch.slot_mapping = torch.tensor(
        [batch.slot(b, p) if b >= 0 else -1 for b, p in zip(tok_req, tok_pos)], dtype=torch.int64)
    return batch


def prefill_cache(cache: torch.Tensor, batch: Batch, full: list[torch.Tensor]) -> None:
    """Store positions 0..ctx-1 of every request (the cached prefix) into `cache`."""
    flat = cache.view(-1, *cache.shape[2:])
    for b, c in enumerate(batch.ctx_lens):
        for p in range(c):
            flat[batch.slot(b, p)] = full[b][p].to(cache.dtype)


def new_tokens(batch: Batch, full: list[torch.Tensor], gen: torch.Generator) -> torch.Tensor:
    """This step's rows: positions ctx.. of each request in token order; padding rows random."""
    rows = [full[b][p] if b >= 0 else torch.randn(full[0].shape[1:], generator=gen).to(full[0].dtype)
            for b, p in zip(batch.tok_req, batch.tok_pos)]
    return torch.stack(rows)


def expected_cache(before: torch.Tensor, batch: Batch, new: torch.Tensor) -> torch.Tensor:
    """`before` with exactly the real tokens' rows written at their slots."""
    exp = before.clone()
    flat = exp.view(-1, *exp.shape[2:])
    for t, b in enumerate(batch.tok_req):
        if b >= 0:
            flat[int(batch.slot_mapping[t])] = new[t].to(exp.dtype)
    return exp


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v in fp64 for one query; q [H, D], k [n, H, D], v [n, H, Dv] -> [H, Dv]."""
    s = torch.einsum("hd,nhd->hn", q.double(), k.double()) * scale
    return torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v.double())


def metadata(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return batch.slot_mapping, batch.block_table, batch.seq_lens, batch.query_start_loc


TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# --------------------------------------------------------------------------- GQA


def gqa_case(name: str, block_size: int, hq: int, hkv: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ctx, ql, n_pad = SCENARIOS[name]
    batch = make_batch(ctx, ql, n_pad, block_size, gen)
    D, Dv = 8, 6  # different value head dim so a K/V mix-up cannot pass
    K = [torch.randn(s, hkv, D, generator=gen).to(dtype) for s in batch.seq_lens_list]
    V = [torch.randn(s, hkv, Dv, generator=gen).to(dtype) for s in batch.seq_lens_list]
    # Garbage everywhere first: reading an unwritten slot would change the result.
    k_cache = torch.randn(batch.num_blocks, block_size, hkv, D, generator=gen).to(dtype)
    v_cache = torch.randn(batch.num_blocks, block_size, hkv, Dv, generator=gen).to(dtype)
    prefill_cache(k_cache, batch, K)
    prefill_cache(v_cache, batch, V)
    q = torch.randn(batch.num_tokens, hq, D, generator=gen).to(dtype)
    k, v = new_tokens(batch, K, gen), new_tokens(batch, V, gen)
    return batch, q, k, v, k_cache, v_cache, K, V


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("block_size,hq,hkv", [(4, 4, 2), (16, 4, 1), (4, 2, 2)])
def test_gqa_matches_dense(name: str, block_size: int, hq: int, hkv: int) -> None:
    dtype = torch.float32
    batch, q, k, v, k_cache, v_cache, K, V = gqa_case(name, block_size, hq, hkv, dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    scale = 1 / math.sqrt(q.shape[-1])
    out = cp.gqa_paged_attention(q, k, v, k_cache, v_cache, *metadata(batch), scale)

    assert out.shape == (batch.num_tokens, hq, V[0].shape[-1]) and out.dtype == dtype
    group = hq // hkv
    for t, (b, p) in enumerate(zip(batch.tok_req, batch.tok_pos)):
        if b < 0:
            assert torch.all(out[t] == 0), "padding tokens must output 0"
            continue
        kk = K[b][: p + 1].repeat_interleave(group, dim=1)
        vv = V[b][: p + 1].repeat_interleave(group, dim=1)
        ref = dense_attention(q[t], kk, vv, scale)
        torch.testing.assert_close(out[t].double(), ref, **TOL[dtype])
    # The caches changed exactly at the new tokens' slots, to exactly the new k/v.
    assert torch.equal(k_cache, expected_cache(k_before, batch, k))
    assert torch.equal(v_cache, expected_cache(v_before, batch, v))


def test_gqa_bf16() -> None:
    dtype = torch.bfloat16
    batch, q, k, v, k_cache, v_cache, K, V = gqa_case("mixed", 4, 4, 2, dtype, seed=1)
    scale = 1 / math.sqrt(q.shape[-1])
    out = cp.gqa_paged_attention(q, k, v, k_cache, v_cache, *metadata(batch), scale)
    assert out.dtype == dtype
    for t, (b, p) in enumerate(zip(batch.tok_req, batch.tok_pos)):
        ref = dense_attention(q[t], K[b][: p + 1].repeat_interleave(2, dim=1),
                              V[b][: p + 1].repeat_interleave(2, dim=1), scale)
        torch.testing.assert_close(out[t].double(), ref, **TOL[dtype])


# --------------------------------------------------------------------------- MLA


def mla_case(name: str, block_size: int, dtype: torch.dtype, seed: int = 0, H: int = 4, L: int = 16, R: int = 4):
    gen = torch.Generator().manual_seed(seed)
    ctx, ql, n_pad = SCENARIOS[name]
    batch = make_batch(ctx, ql, n_pad, block_size, gen)
    C = [torch.randn(s, L, generator=gen).to(dtype) for s in batch.seq_lens_list]  # latents
    P = [torch.randn(s, R, generator=gen).to(dtype) for s in batch.seq_lens_list]  # rope keys
    kv_cache = torch.randn(batch.num_blocks, block_size, L + R, generator=gen).to(dtype)
    prefill_cache(kv_cache, batch, [torch.cat([c, p], -1) for c, p in zip(C, P)])
    kv_c, k_pe = new_tokens(batch, C, gen), new_tokens(batch, P, gen)
    q_pe = torch.randn(batch.num_tokens, H, R, generator=gen).to(dtype)
    return gen, batch, kv_c, k_pe, kv_cache, q_pe, C, P


@pytest.mark.parametrize("name", ["decode", "chunked_prefill", "mixed", "padding"])
def test_mla_absorbed_equals_up_projected(name: str) -> None:
    """Absorbed MLA (latent-space MQA, W_UK in q, W_UV after) == standard MHA with explicit K/V."""
    H, L, R, dn, dv = 4, 16, 4, 8, 6
    gen, batch, kv_c, k_pe, kv_cache, q_pe, C, P = mla_case(name, 4, torch.float32, H=H, L=L, R=R)
    W_UK = torch.randn(H, dn, L, generator=gen) / math.sqrt(L)  # k_nope[h] = W_UK[h] @ c
    W_UV = torch.randn(H, L, dv, generator=gen) / math.sqrt(L)  # v[h] = c @ W_UV[h]
    q_nope = torch.randn(batch.num_tokens, H, dn, generator=gen)
    scale = 1 / math.sqrt(dn + R)  # the model's softmax scale: the un-absorbed head dim
    before = kv_cache.clone()

    q_abs = torch.einsum("thn,hnl->thl", q_nope, W_UK)  # [T, H, L]
    lat = cp.mla_attention(q_abs, q_pe, kv_c, k_pe, kv_cache, *metadata(batch), scale)
    assert lat.shape == (batch.num_tokens, H, L)
    out = torch.einsum("thl,hlv->thv", lat.double(), W_UV.double())

    for t, (b, p) in enumerate(zip(batch.tok_req, batch.tok_pos)):
        if b < 0:
            assert torch.all(lat[t] == 0)
            continue
        c = C[b][: p + 1].double()  # [n, L]
        k_nope = torch.einsum("nl,hdl->nhd", c, W_UK.double())  # [n, H, dn]
        k = torch.cat([k_nope, P[b][: p + 1].double()[:, None, :].expand(-1, H, -1)], -1)
        v = torch.einsum("nl,hlv->nhv", c, W_UV.double())  # [n, H, dv]
        ref = dense_attention(torch.cat([q_nope[t], q_pe[t]], -1), k, v, scale)
        torch.testing.assert_close(out[t], ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_cache, expected_cache(before, batch, torch.cat([kv_c, k_pe], -1)))


def test_mla_bf16() -> None:
    H, L = 4, 16
    gen, batch, kv_c, k_pe, kv_cache, q_pe, C, P = mla_case("mixed", 4, torch.bfloat16, seed=2, H=H, L=L)
    q_nope = torch.randn(batch.num_tokens, H, L, generator=gen).to(torch.bfloat16)
    scale = 0.2
    lat = cp.mla_attention(q_nope, q_pe, kv_c, k_pe, kv_cache, *metadata(batch), scale)
    assert lat.dtype == torch.bfloat16
    for t, (b, p) in enumerate(zip(batch.tok_req, batch.tok_pos)):
        k = torch.cat([C[b][: p + 1], P[b][: p + 1]], -1)[:, None, :].expand(-1, H, -1)
        ref = dense_attention(torch.cat([q_nope[t], q_pe[t]], -1), k, C[b][: p + 1][:, None, :].expand(-1, H, -1), scale)
        torch.testing.assert_close(lat[t].double(), ref, **TOL[torch.bfloat16])


# --------------------------------------------------------------------------- lightning indexer


def indexer_case(name: str, seed: int = 0, Hi: int = 4, Di: int = 8, block_size: int = 4):
    gen = torch.Generator().manual_seed(seed)
    ctx, ql, n_pad = SCENARIOS[name]
    batch = make_batch(ctx, ql, n_pad, block_size, gen)
    KI = [torch.randn(s, Di, generator=gen) for s in batch.seq_lens_list]
    cache = torch.randn(batch.num_blocks, block_size, Di, generator=gen)
    prefill_cache(cache, batch, KI)
    q_i = torch.randn(batch.num_tokens, Hi, Di, generator=gen)
    w = torch.randn(batch.num_tokens, Hi, generator=gen)
    return batch, q_i, new_tokens(batch, KI, gen), w, cache, KI


def brute_force_topk(q_i: torch.Tensor, w: torch.Tensor, keys: torch.Tensor,
                     topk: int) -> tuple[list[int], torch.Tensor]:
    """Loops over every key; order by (-score, position); -1 padded. Also the float64 scores."""
    scores = []
    for s in range(keys.shape[0]):
        sc = sum(float(w[j]) * max(0.0, float(q_i[j].double() @ keys[s].double())) for j in range(q_i.shape[0]))
        scores.append((-sc, s))
    picked = [s for _, s in sorted(scores)[:topk]]
    return picked + [-1] * (topk - len(picked)), torch.tensor([[-sc for sc, _ in scores]], dtype=torch.float64)


@pytest.mark.parametrize("name", ["decode", "mixed", "padding", "multi_query_decode"])
@pytest.mark.parametrize("topk", [3, 8])
def test_indexer_matches_brute_force(name: str, topk: int) -> None:
    batch, q_i, k_i, w, cache, KI = indexer_case(name)
    before = cache.clone()
    idx = cp.lightning_indexer(q_i, k_i, w, cache, *metadata(batch), topk)
    assert idx.dtype == torch.int32 and idx.shape == (batch.num_tokens, topk)
    for t, (b, p) in enumerate(zip(batch.tok_req, batch.tok_pos)):
        if b < 0:
            assert idx[t].tolist() == [-1] * topk
            continue
        # fp32 op vs float64 loop: the same top-k up to keys whose scores tie within rounding.
        want, scores = brute_force_topk(q_i[t], w[t], KI[b][: p + 1], topk)
        assert_same_topk(idx[t:t + 1], torch.tensor([want]), scores, what=f"token {t} (req {b}, pos {p})")
        if p + 1 < topk:  # fewer keys than topk: exactly pos+1 entries, then -1
            assert (idx[t] >= 0).sum() == p + 1 and idx[t, p + 1:].eq(-1).all()
    assert torch.equal(cache, expected_cache(before, batch, k_i))


def test_indexer_ties_prefer_lower_position() -> None:
    batch, q_i, k_i, w, cache, KI = indexer_case("mixed", seed=3)
    w[:] = 0.0  # every score is exactly 0: a pure tie
    idx = cp.lightning_indexer(q_i, k_i, w, cache, *metadata(batch), 5)
    for t, p in enumerate(batch.tok_pos):
        n = min(p + 1, 5)
        assert idx[t].tolist() == list(range(n)) + [-1] * (5 - n)


# --------------------------------------------------------------------------- sparse MLA


@pytest.mark.parametrize("name", ["decode", "mixed", "padding"])
def test_sparse_mla_all_positions_equals_dense(name: str) -> None:
    gen, batch, kv_c, k_pe, kv_cache, q_pe, C, P = mla_case(name, 4, torch.float32, seed=4)
    q_nope = torch.randn(batch.num_tokens, q_pe.shape[1], C[0].shape[-1], generator=gen)
    K = max(batch.seq_lens_list) + 2  # topk >= every sequence length
    indices = torch.full((batch.num_tokens, K), -1, dtype=torch.int32)
    for t, p in enumerate(batch.tok_pos):
        # All of 0..pos in a shuffled order: the result must not depend on index order.
        indices[t, : p + 1] = torch.randperm(p + 1, generator=gen).to(torch.int32)
    meta = metadata(batch)
    dense_cache = kv_cache.clone()
    before = kv_cache.clone()
    sparse = cp.sparse_mla_attention(q_nope, q_pe, kv_c, k_pe, kv_cache, *meta, indices, 0.3)
    dense = cp.mla_attention(q_nope, q_pe, kv_c, k_pe, dense_cache, *meta, 0.3)
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_cache, dense_cache)
    assert torch.equal(kv_cache, expected_cache(before, batch, torch.cat([kv_c, k_pe], -1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_mla_random_subset(dtype: torch.dtype) -> None:
    gen, batch, kv_c, k_pe, kv_cache, q_pe, C, P = mla_case("padding", 4, dtype, seed=5)
    H, L = q_pe.shape[1], C[0].shape[-1]
    q_nope = torch.randn(batch.num_tokens, H, L, generator=gen).to(dtype)
    K = 6
    indices = torch.full((batch.num_tokens, K), -1, dtype=torch.int32)
    subsets: list[list[int]] = []
    for t, b in enumerate(batch.tok_req):
        if b < 0:
            subsets.append([])
            indices[t] = torch.randint(0, 3, (K,), generator=gen).to(torch.int32)  # ignored: padding token
            continue
        # Any cached position, even past pos (no causal crop), scattered among -1 holes;
        # t == 0 keeps an empty row (all -1) to check out = 0.
        n = 0 if t == 0 else int(torch.randint(1, min(K, batch.seq_lens_list[b]) + 1, (1,), generator=gen))
        pos = torch.randperm(batch.seq_lens_list[b], generator=gen)[:n]
        cols = torch.randperm(K, generator=gen)[:n]
        indices[t, cols] = pos.to(torch.int32)
        subsets.append(pos.tolist())
    scale = 0.25
    out = cp.sparse_mla_attention(q_nope, q_pe, kv_c, k_pe, kv_cache, *metadata(batch), indices, scale)
    for t, b in enumerate(batch.tok_req):
        if not subsets[t]:
            assert torch.all(out[t] == 0)
            continue
        sel = torch.tensor(subsets[t])
        kk = torch.cat([C[b][sel], P[b][sel]], -1)[:, None, :].expand(-1, H, -1)
        ref = dense_attention(torch.cat([q_nope[t], q_pe[t]], -1), kk, C[b][sel][:, None, :].expand(-1, H, -1), scale)
        torch.testing.assert_close(out[t].double(), ref, **TOL[dtype])


def test_sparse_attention_with_lse_reference() -> None:
    """The reusable helper (also used for SFA DCP with local indices): lse and empty rows."""
    gen, batch, kv_c, k_pe, kv_cache, q_pe, C, P = mla_case("padding", 4, torch.float32, seed=6)
    paged_cache.write_cache(kv_cache, torch.cat([kv_c, k_pe], -1), batch.slot_mapping)
    H, L = q_pe.shape[1], C[0].shape[-1]
    q = torch.randn(batch.num_tokens, H, L + q_pe.shape[-1], generator=gen)
    indices = torch.full((batch.num_tokens, 3), -1, dtype=torch.int32)
    indices[1:, 0] = 0
    indices[1:, 2] = 1  # every request holds >= 2 tokens; padding rows must still be ignored
    out, lse = sparse_reference.sparse_attention_with_lse(q, kv_cache, batch.block_table, batch.query_start_loc,
                                                   indices, L, 0.5)
    assert out.shape == (batch.num_tokens, H, L) and lse.dtype == torch.float32
    assert torch.all(out[0] == 0) and torch.all(lse[0] == float("-inf"))  # all -1 row
    for t, b in enumerate(batch.tok_req):
        if b < 0:
            assert torch.all(out[t] == 0) and torch.all(lse[t] == float("-inf"))
        elif t > 0:
            kv = torch.cat([C[b][:2], P[b][:2]], -1).double()  # positions 0 and 1
            s = q[t].double() @ kv.T * 0.5  # [H, 2]
            torch.testing.assert_close(lse[t].double(), torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out[t].double(), torch.softmax(s, -1) @ kv[:, :L], atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- opcheck


def _opcheck_cases():
    batch, q, k, v, k_cache, v_cache, _, _ = gqa_case("padding", 4, 4, 2, torch.float32)
    meta = metadata(batch)
    yield "gqa", cp.gqa_paged_attention.default, (q, k, v, k_cache, v_cache, *meta, 0.3), (3, 4)
    gen, batch, kv_c, k_pe, kv_cache, q_pe, C, _ = mla_case("padding", 4, torch.float32)
    meta = metadata(batch)
    q_nope = torch.randn(batch.num_tokens, q_pe.shape[1], C[0].shape[-1], generator=gen)
    yield "mla", cp.mla_attention.default, (q_nope, q_pe, kv_c, k_pe, kv_cache, *meta, 0.3), (4,)
    indices = torch.randint(-1, 3, (batch.num_tokens, 5), generator=gen, dtype=torch.int32)
    yield "sparse_mla", cp.sparse_mla_attention.default, \
        (q_nope, q_pe, kv_c, k_pe, kv_cache, *meta, indices, 0.3), (4,)
    batch, q_i, k_i, w, cache, _ = indexer_case("padding")
    yield "indexer", cp.lightning_indexer.default, (q_i, k_i, w, cache, *metadata(batch), 4), (3,)


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck(case) -> None:
    _, op, args, cache_pos = case
    args = list(args)
    for i in cache_pos:  # opcheck runs the op several times; never share a test's caches
        args[i] = args[i].clone()
    torch.library.opcheck(op, tuple(args))
