"""DSA-CP token shards: the layout math (property tests) and the two row ops (opcheck,
bit-identity with the single-device ops on the same rows), in one process."""

from __future__ import annotations

import pytest
import torch

from cp_compile.ops.core import layout
from cp_compile.testing.topk import assert_same_topk, scores_for_step

L, R, HI, DI, TOPK = 16, 8, 2, 8, 5


def _batch(g: torch.Generator, *, malformed: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Random (query_start_loc, seq_lens, T with padding). malformed: seq_lens below the
    query lengths, as graph padding can give, which must still never yield a negative length."""
    B = int(torch.randint(1, 6, (1,), generator=g))
    q_len = torch.randint(1, 7, (B,), generator=g)
    ctx = torch.randint(0, 9, (B,), generator=g)
    seq = ctx + q_len
    if malformed:
        seq = torch.randint(0, 3, (B,), generator=g)
    qsl = torch.cat([torch.zeros(1, dtype=torch.int64), q_len.cumsum(0)]).to(torch.int32)
    pad = int(torch.randint(0, 4, (1,), generator=g))
    return qsl, seq.to(torch.int32), int(qsl[-1]) + pad


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 8])
def test_token_shards_cover_every_token_once(tp: int) -> None:
    g = torch.Generator().manual_seed(tp)
    for trial in range(40):
        qsl, seq, T = _batch(g, malformed=trial % 5 == 4)
        rows = layout.token_shard_rows(T, tp=tp)
        assert rows * tp >= T > (rows - 1) * tp  # T_pad - T < tp
        reqs, kvs = zip(*(layout.shard_row_metadata(qsl, seq, rows, tp=tp, rank=r) for r in range(tp)))
        req, kv = torch.cat(reqs), torch.cat(kvs)  # [T_pad] in rank order
        real = int(qsl[-1])
        # Every real token on exactly one rank, at its own row, with its own request ...
        assert torch.equal(req[:real], layout.request_index(qsl, real))
        assert (req[real:] == -1).all() and (kv[real:] == 0).all()  # padding rows: (-1, 0)
        assert (kv >= 0).all()
        if trial % 5 != 4:
            # ... and its single-device causal length.
            assert torch.equal(kv[:real], layout.causal_lens(qsl, seq, real))
        # The per-request (TND) view describes the same rows.
        for r in range(tp):
            n, k = layout.shard_request_lens(qsl, seq, rows, tp=tp, rank=r)
            assert (n >= 0).all() and (k >= 0).all()
            row_req, row_kv = reqs[r], kvs[r]
            for b in range(qsl.shape[0] - 1):
                mine = row_kv[row_req == b]
                assert mine.numel() == int(n[b])
                if mine.numel() and trial % 5 != 4:
                    want = int(k[b]) - torch.arange(mine.numel() - 1, -1, -1)  # bottom-right causal
                    assert torch.equal(mine.long(), want), (tp, r, b)
        assert sum(int(layout.shard_request_lens(qsl, seq, rows, tp=tp, rank=r)[0].sum()) for r in range(tp)) == real


def test_shard_request_lens_vllm_vector() -> None:
    """Two requests, qsl [0, 3, 5], tp 2, rank 1 (rows 3..5): no row of request 0, both of request 1."""
    qsl, seq = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32)
    n, k = layout.shard_request_lens(qsl, seq, 3, tp=2, rank=1)
    assert n.tolist() == [0, 2] and k.tolist() == [0, 5]
    req, kv = layout.shard_row_metadata(qsl, seq, 3, tp=2, rank=1)
    assert req.tolist() == [1, 1, -1] and kv.tolist() == [4, 5, 0]
    with pytest.raises(ValueError):
        layout.shard_row_metadata(qsl, seq, 3, tp=2, rank=2)


def _step(g: torch.Generator):
    """A chunked-prefill + decode step: request 0 has 4 cached + 5 new tokens, request 1 7 + 1; 1 padding token."""
    qsl = torch.tensor([0, 5, 6], dtype=torch.int32)
    seq = torch.tensor([9, 8], dtype=torch.int32)
    bt = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    T = 7
    index_cache = torch.randn(6, 4, DI, generator=g)
    index_cache[:, 1] = index_cache[:, 0]  # ties
    latent = torch.randn(6, 4, L + R, generator=g)
    return qsl, seq, bt, T, index_cache, latent


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_row_ops_equal_single_device_rows(tp: int) -> None:
    g = torch.Generator().manual_seed(0)
    qsl, seq, bt, T, index_cache, latent = _step(g)
    q_i, w = torch.randn(T, HI, DI, generator=g), torch.rand(T, HI, generator=g)
    q_nope, q_pe = torch.randn(T, 4, L, generator=g), torch.randn(T, 4, R, generator=g)
    kv_lens = layout.causal_lens(qsl, seq, T)
    ref_topk = torch.ops.cp.lightning_indexer_topk_rows(q_i, index_cache, w, bt, seq, qsl, 1, 0, TOPK)
    from cp_compile.ops.sparse import reference as sparse_reference
    assert torch.equal(ref_topk, sparse_reference.lightning_indexer_topk(q_i, index_cache, w, bt, qsl, kv_lens, TOPK))
    ref_out = sparse_reference.sparse_attention_with_lse(torch.cat([q_nope, q_pe], -1), latent, bt, qsl, ref_topk, L,
                                                  0.3)[0]
    rows = layout.token_shard_rows(T, tp=tp)
    pad = rows * tp - T
    P = lambda x: torch.nn.functional.pad(x, (0, 0) * (x.dim() - 1) + (0, pad))  # noqa: E731
    topks, outs = [], []
    for r in range(tp):
        sl = slice(r * rows, (r + 1) * rows)
        tk = torch.ops.cp.lightning_indexer_topk_rows(P(q_i)[sl], index_cache, P(w)[sl], bt, seq, qsl, tp, r, TOPK)
        outs.append(torch.ops.cp.sparse_mla_rows_attention(P(q_nope)[sl], P(q_pe)[sl], latent, bt, seq, qsl, tk,
                                                           tp, r, 0.3))
        topks.append(tk)
    topk, out = torch.cat(topks), torch.cat(outs)
    # Row shards score with other matmul shapes than all rows at once: the same top-k up to
    # keys tied within rounding, and the same output to fp32 tolerance (not bitwise: issue 19).
    scores = scores_for_step(q_i, index_cache, w, bt, qsl, kv_lens)
    assert_same_topk(topk[:T], ref_topk, scores, what=f"tp {tp} shards")
    assert (topk[T:] == -1).all()
    torch.testing.assert_close(out[:T], ref_out, atol=1e-5, rtol=1e-5)
    assert (out[T:] == 0).all()
    assert (ref_topk == -1).any() and (ref_topk >= 0).any()


def test_row_ops_opcheck() -> None:
    g = torch.Generator().manual_seed(1)
    qsl, seq, bt, T, index_cache, latent = _step(g)
    rows = layout.token_shard_rows(T, tp=2)
    q_i, w = torch.randn(rows, HI, DI, generator=g), torch.rand(rows, HI, generator=g)
    torch.library.opcheck(torch.ops.cp.lightning_indexer_topk_rows, (q_i, index_cache, w, bt, seq, qsl, 2, 1, TOPK))
    idx = torch.ops.cp.lightning_indexer_topk_rows(q_i, index_cache, w, bt, seq, qsl, 2, 1, TOPK)
    args = (torch.randn(rows, 4, L, generator=g), torch.randn(rows, 4, R, generator=g), latent, bt, seq, qsl, idx,
            2, 1, 0.3)
    torch.library.opcheck(torch.ops.cp.sparse_mla_rows_attention, args)
