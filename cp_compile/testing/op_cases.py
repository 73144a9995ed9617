"""One small, realistic call of every cp:: op (issue 22): the device kernels' test cases.

`op_cases(device, dtype)` -> {op name: (args, mutated arg positions)} for one
flattened batch of two requests with a cached context, a padding token, shuffled
pages, GQA (4 query / 2 KV heads), MLA (latent 16 + rope 8), the lightning indexer
(integer-valued inputs, so every score is exact in fp32 and a top-k can be compared
index for index across two implementations), DCP (2 ranks, this is rank 1), DSA-CP
(tp 2, rank 1) and the W8A8 linears. Tests run each op's registered device kernel
and its CPU reference on the same case; the device script runs them on a GPU in
fp32 / bf16 / fp16.
"""

from __future__ import annotations

from typing import Any

import torch

from cp_compile.ops.core import layout

BS, NB = 4, 8  # page size, pages
QSL, SEQ = [0, 3, 5], [9, 6]  # request 0: 6 cached + 3 new, request 1: 4 cached + 2 new
T = 6  # 5 real tokens + 1 padding
SCALE = 0.25
TOPK = 4


def _batch(device: torch.device, gen: torch.Generator) -> dict[str, torch.Tensor]:
    qsl = torch.tensor(QSL, dtype=torch.int32)
    seq = torch.tensor(SEQ, dtype=torch.int32)
    bt = torch.randperm(NB, generator=gen)[:6].view(2, 3).to(torch.int32)
    pos, req = layout.token_positions(qsl, seq, T)
    slots = torch.where(req >= 0, bt.long()[req.clamp(min=0), pos.clamp(min=0) // BS] * BS + pos % BS,
                        torch.full_like(pos, -1).long())
    kv_lens = layout.causal_lens(qsl, seq, T)
    return {k: v.to(device) for k, v in dict(qsl=qsl, seq=seq, bt=bt, slots=slots.long(), kv_lens=kv_lens).items()}


def op_cases(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             seed: int = 0) -> dict[str, tuple[tuple[Any, ...], tuple[int, ...]]]:
    """{op: (args, indices of the args it writes in place)}; fresh tensors on every call."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    b = _batch(device, gen)

    def rnd(*shape: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dt)

    def ints(*shape: int) -> torch.Tensor:  # small integers: exact in every float dtype and every sum order
        return torch.randint(-3, 4, shape, generator=gen).to(device=device, dtype=dtype)

    def codes(*shape: int) -> torch.Tensor:  # int8 KV codes
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8).to(device)

    def scales(*shape: int) -> torch.Tensor:  # fp32 per-token scales, positive, of a real amax / 127
        return (torch.rand(*shape, generator=gen) / 40 + 0.005).to(device)

    qsl, seq, bt, slots, kv_lens = b["qsl"], b["seq"], b["bt"], b["slots"], b["kv_lens"]
    Hq, Hkv, D, H, L, R, Hi, Di = 4, 2, 16, 2, 16, 8, 2, 8
    idx_cache = ints(NB, BS, Di)
    indices = torch.tensor([[0, 5, 2, -1], [1, 3, 7, 8], [8, 0, -1, -1], [2, 0, 1, 3], [5, 4, -1, 1],
                            [-1, -1, -1, -1]], dtype=torch.int32, device=device)
    local_lens = layout.local_causal_lens(qsl, seq, T, cp=2, rank=1, interleave=1)
    rows = layout.token_shard_rows(T, tp=2)
    x = rnd(T, 32)
    w_int8 = torch.randint(-127, 128, (32, 16), generator=gen, dtype=torch.int8).to(device)
    lse_parts = rnd(2, T, 2, dt=torch.float32)
    lse_parts[0, 1] = float("-inf")  # an empty shard
    return {
        "cp::cache_write": ((rnd(T, Hkv, D), torch.zeros(NB, BS, Hkv, D, dtype=dtype, device=device), slots), (1,)),
        "cp::dcp_localize_metadata": ((slots, qsl, seq, 2, 1, 1, BS), ()),
        "cp::paged_attention_lse": ((rnd(T, Hq, D), rnd(NB, BS, Hkv, D), rnd(NB, BS, Hkv, D), bt, qsl, local_lens,
                                     SCALE), ()),
        "cp::mla_partial_attention": ((rnd(T, H, L), rnd(T, H, R), rnd(NB, BS, L + R), bt, qsl, local_lens, SCALE),
                                      ()),
        "cp::lse_rescale": ((rnd(T, 2, D), lse_parts[1], lse_parts.permute(0, 2, 1).reshape(4, T).contiguous()), ()),
        "cp::lse_combine": ((rnd(2, T, 2, D), lse_parts), ()),
        "cp::gqa_paged_attention": ((rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D), rnd(NB, BS, Hkv, D),
                                     rnd(NB, BS, Hkv, D), slots, bt, seq, qsl, SCALE), (3, 4)),
        "cp::mla_attention": ((rnd(T, H, L), rnd(T, H, R), rnd(T, L), rnd(T, R), rnd(NB, BS, L + R), slots, bt, seq,
                               qsl, SCALE), (4,)),
        "cp::lightning_indexer": ((ints(T, Hi, Di), ints(T, Di), ints(T, Hi), idx_cache, slots, bt, seq, qsl, TOPK),
                                  (3,)),
        "cp::lightning_indexer_topk_rows": ((ints(rows, Hi, Di), idx_cache, ints(rows, Hi), bt, seq, qsl, 2, 1, TOPK),
                                            ()),
        "cp::sparse_mla_attention": ((rnd(T, H, L), rnd(T, H, R), rnd(T, L), rnd(T, R), rnd(NB, BS, L + R), slots, bt,
                                      seq, qsl, indices, SCALE), (4,)),
        "cp::sparse_mla_partial_attention": ((rnd(T, H, L), rnd(T, H, R), rnd(NB, BS, L + R), bt, qsl, indices,
                                              SCALE), ()),
        "cp::sparse_mla_rows_attention": ((rnd(rows, H, L), rnd(rows, H, R), rnd(NB, BS, L + R), bt, seq, qsl,
                                           indices[rows:], 2, 1, SCALE), ()),
        "cp::dcp_sparse_indices": ((indices, 2, 1, 1, BS), ()),
        "cp::w8a8_dynamic_linear": ((x, w_int8, torch.rand(16, generator=gen).to(device) / 50,
                                     torch.randint(-3, 4, (16,), generator=gen, dtype=torch.int32).to(device), 2), ()),
        "cp::w8a8_static_linear": ((x, w_int8, torch.tensor([0.02, 0.03], device=device),
                                    torch.tensor([1, -2], dtype=torch.int32, device=device),
                                    torch.randint(-50, 50, (2, 16), generator=gen, dtype=torch.int32).to(device),
                                    torch.rand(2, 16, generator=gen).to(device) / 1000), ()),
        # MLAPO (issue 27): q-LoRA 12 from hidden 32, H heads of nope 8 + rope R, latent L, cache write.
        "cp::mla_preprocess": ((x, rnd(12, 32) / 6, None, None, 1 + rnd(12) / 5, rnd(H * (8 + R), 12) / 4, None, None,
                                rnd(L + R, 32) / 6, None, None, 1 + rnd(L) / 5, rnd(H, 8, L) / 3,
                                torch.rand(T, R // 2, generator=gen).to(device),
                                torch.rand(T, R // 2, generator=gen).to(device),
                                torch.zeros(NB, BS, L + R, dtype=dtype, device=device), slots, 1e-6, 1e-6,
                                "interleave"), (15,)),
        # ... into an int8 latent cache with its per-token scales (issue 39), context already cached.
        "cp::mla_preprocess_quant": ((x, rnd(12, 32) / 6, None, None, 1 + rnd(12) / 5, rnd(H * (8 + R), 12) / 4, None,
                                      None, rnd(L + R, 32) / 6, None, None, 1 + rnd(L) / 5, rnd(H, 8, L) / 3,
                                      torch.rand(T, R // 2, generator=gen).to(device),
                                      torch.rand(T, R // 2, generator=gen).to(device),
                                      codes(NB, BS, L + R), scales(NB, BS, 1), slots, 1e-6, 1e-6, "interleave"),
                                     (15, 16)),
        # Quantised KV (issue 39): int8 pages with an fp32 scale per token and KV head (MLA: per token),
        # the cached context as codes and scales already there, the new tokens quantised by the op.
        "cp::quant_cache_write": ((rnd(T, Hkv, D), codes(NB, BS, Hkv, D), scales(NB, BS, Hkv), slots), (1, 2)),
        "cp::gqa_paged_attention_quant": ((rnd(T, Hq, D), rnd(T, Hkv, D), rnd(T, Hkv, D), codes(NB, BS, Hkv, D),
                                           codes(NB, BS, Hkv, D), scales(NB, BS, Hkv), scales(NB, BS, Hkv), slots, bt,
                                           seq, qsl, SCALE), (3, 4, 5, 6)),
        "cp::mla_attention_quant": ((rnd(T, H, L), rnd(T, H, R), rnd(T, L), rnd(T, R), codes(NB, BS, L + R),
                                     scales(NB, BS, 1), slots, bt, seq, qsl, SCALE), (4, 5)),
        "cp::sparse_mla_attention_quant": ((rnd(T, H, L), rnd(T, H, R), rnd(T, L), rnd(T, R), codes(NB, BS, L + R),
                                            scales(NB, BS, 1), slots, bt, seq, qsl, indices, SCALE), (4, 5)),
    }


def clone_args(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def flat_outputs(result: Any) -> list[torch.Tensor]:
    if result is None:
        return []
    if isinstance(result, torch.Tensor):
        return [result]
    return [r for r in result if isinstance(r, torch.Tensor)]


__all__ = ["clone_args", "flat_outputs", "op_cases"]
