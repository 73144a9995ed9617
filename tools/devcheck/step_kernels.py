"""Step kernels: every cp:: op through dispatch vs its torch reference.

- edge: `cp_compile.testing.op_cases` (every op, two requests with cached context,
  a padding token, shuffled pages, an empty DCP shard) in fp32 and bf16;
- production (bf16): GQA decode with 1 KV head and 8 / 16 / 64 query heads at D 128,
  MLA partial decode at 16 / 128 heads of 512 + 64, sparse MLA at top-2048, the
  lightning indexer at 64 heads x 128, top-2048; contexts of a full request, one key,
  none (an empty shard) and one ending mid-page, unread slots NaN.
The reference is the op's body on fp32 copies on the CPU. Any NaN / inf where the
reference is finite fails (`common.max_err`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from tools.devcheck.cases import cache, paged_batch
from tools.devcheck.common import Ctx, cp_call, flat, max_err, reference, seeded, tol, within, worst  # noqa: F401

# (GQA groups, D), MLA (heads, L, R), sparse (heads, topk), indexer (heads, Di, topk), context, block
DEVICE = dict(gqa=((8, 128), (16, 128), (64, 128)), mla=((16, 512, 64), (128, 512, 64)), sparse=(16, 2048),
              indexer=(64, 128, 2048), ctx=8192, block=64)
REHEARSE = dict(gqa=((8, 32),), mla=((16, 32, 8),), sparse=(4, 16), indexer=(4, 16, 16), ctx=40, block=8)


def _fp32_cpu(args: tuple) -> tuple:
    return tuple(a.detach().cpu().float() if isinstance(a, torch.Tensor) and a.is_floating_point()
                 else a.detach().cpu().clone() if isinstance(a, torch.Tensor) else a for a in args)


def _compare(ctx: Ctx, op: str, args: tuple, mutated: tuple[int, ...], dtype: torch.dtype) -> dict[str, Any]:
    """{max_err, tol, ok}, or {error, ok: False} when the kernel raises (the next case still runs)."""
    try:
        err = _max_err(ctx, op, args, mutated)
    except Exception as exc:  # noqa: BLE001
        cause = exc.__cause__ or exc
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]} (cause: {cause!r})"[:400], "ok": False}
    return {"max_err": err, "tol": tol(dtype, ctx.device), "ok": within(err, dtype, ctx.device)}


_CODES = (torch.int8, torch.float8_e4m3fn)


def _dequantised(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A quantised cache [NB, BS, ..., D] read as values: codes x their per-row fp32 scales."""
    return codes.detach().cpu().float() * scales.detach().cpu().float().reshape(*codes.shape[:-1], 1)


def _mutated_pairs(args: tuple, ref_args: tuple, mutated: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(got, want) per written argument. A quantised cache and its scale cache (the next written
    argument) are compared as the values they store: a kernel that quantises a value it computed
    in bf16 / fp16 (the MLAPO latent) may round a code the other way from the fp32 reference, one
    code step, which the integer count would call a failure; the values differ by one scale step."""
    pairs, skip = [], set()
    for k, i in enumerate(mutated):
        if i in skip:
            continue
        j = mutated[k + 1] if k + 1 < len(mutated) else None
        a = args[i]
        if isinstance(a, torch.Tensor) and a.dtype in _CODES and j is not None and args[j].dtype == torch.float32 \
                and args[j].numel() == a.shape[:-1].numel():
            pairs.append((_dequantised(a, args[j]), _dequantised(ref_args[i], ref_args[j])))
            skip.add(j)
        else:
            pairs.append((a, ref_args[i]))
    return pairs


def _max_err(ctx: Ctx, op: str, args: tuple, mutated: tuple[int, ...]) -> float:
    ref_args = _fp32_cpu(args)
    got = cp_call(ctx, op, *args)
    want = reference(op)(*ref_args)
    pairs = list(zip(flat(got), flat(want))) + _mutated_pairs(args, ref_args, mutated)
    return worst([max_err(g, w) for g, w in pairs])


def _production(ctx: Ctx, s: dict[str, Any]) -> Iterator[tuple[str, str, tuple, tuple[int, ...]]]:
    dev, dt, n = ctx.device, torch.bfloat16, s["ctx"]
    g = seeded(1, torch.device("cpu"))
    lens = [n, 1, 0, n // 2 + 13]  # full, one key, an empty shard, ends mid-page
    p = paged_batch(lens, s["block"], dev, g)
    B = len(lens)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(device=dev, dtype=dt)

    for G, D in s["gqa"]:
        yield (f"GQA 1 KV head x {G} q heads, D {D}", "paged_attention_lse",
               (rnd(B, G, D), cache(p, 1, D, dtype=dt, gen=g), cache(p, 1, D, dtype=dt, gen=g), p.block_table,
                p.query_start_loc, p.kv_lens, D ** -0.5), ())
    for H, L, R in s["mla"]:
        yield (f"MLA {H} heads, {L}+{R}", "mla_partial_attention",
               (rnd(B, H, L), rnd(B, H, R), cache(p, L + R, dtype=dt, gen=g), p.block_table, p.query_start_loc,
                p.kv_lens, (L + R) ** -0.5), ())
    H, K = s["sparse"]
    L, R = s["mla"][0][1], s["mla"][0][2]
    # no NaN poison here: the sparse reference (the op's body) reads whole pages, so NaN
    # in a slot no index lists reaches its output (the kernel reads only the listed slots)
    idx = torch.full((B, K), -1, dtype=torch.int32)
    for b, ln in enumerate(lens):  # distinct positions of the request, -1 past them
        k = min(K, ln)
        idx[b, :k] = torch.randperm(ln, generator=g)[:k].to(torch.int32)
    yield (f"sparse MLA {H} heads, top-{K}", "sparse_mla_partial_attention",
           (rnd(B, H, L), rnd(B, H, R), cache(p, L + R, dtype=dt, gen=g, poison=False), p.block_table,
            p.query_start_loc, idx.to(dev), (L + R) ** -0.5), ())
    Hi, Di, K = s["indexer"]
    seq = p.kv_lens.clamp(min=1)  # the indexer's token is the request's last (seq >= 1)
    pos = seq.long() - 1

    def ints(*shape: int) -> torch.Tensor:  # exact scores in fp32: top-k comparable index for index
        return torch.randint(-3, 4, shape, generator=g).to(device=dev, dtype=dt)

    pi = paged_batch(seq.tolist(), s["block"], dev, g)
    slots = pi.block_table.long()[torch.arange(B, device=dev), pos // p.block] * p.block + pos % p.block
    yield (f"indexer {Hi} heads x {Di}, top-{K}", "lightning_indexer",
           (ints(B, Hi, Di), ints(B, Di), ints(B, Hi), cache(pi, Di, dtype=dt, gen=g, poison=False).round().clamp(-3, 3),
            slots, pi.block_table, seq, pi.query_start_loc, K), (3,))


def run(ctx: Ctx) -> Iterator[dict[str, Any]]:
    import cp_compile.ops  # noqa: F401
    from cp_compile.testing.op_cases import op_cases

    s = REHEARSE if ctx.rehearse else DEVICE
    for name, op, args, mutated in _production(ctx, s):
        yield {"case": f"production: {name}", "op": f"cp::{op}", "dtype": "bfloat16",
               **_compare(ctx, op, args, mutated, torch.bfloat16)}
    # the rehearsal's edges run fp16 for bf16: the interpreter's tl.dot reads bf16 operands as
    # integers (the production rows' decode kernels take the broadcast product there)
    for dtype in (torch.float32, torch.float16 if ctx.rehearse else torch.bfloat16):
        for op, (args, mutated) in sorted(op_cases("cpu", dtype).items()):
            args = tuple(a.to(ctx.device) if isinstance(a, torch.Tensor) else a for a in args)
            yield {"case": "edge: op_cases", "op": op, "dtype": str(dtype).split(".")[1],
                   **_compare(ctx, op.split("::")[1], args, mutated, dtype)}
