"""The Triton launches the project makes at its production shapes on an H200, for the AOT check.

`tools/aot_cuda_check.py --production` compiles these (issue 36 item 2): the tiles the
launchers actually pick, captured from the real launchers on CPU tensors with
`capture_launches` + `planning_for("cuda", 132)` (nothing runs; caches are zero-stride
views, so 128k contexts cost no memory), at
- GQA decode and prefill: D 128, 8 / 16 / 64 query heads per KV head (one KV head a rank);
- MLA decode and prefill: 16 and 128 heads of 512 + 64;
- sparse MLA: top-2048, 16 and 128 heads; indexer: 64 heads x 128;
- the DCP merges (all-to-all combine, LSE rescale) over 8 ranks at those heads;
- batch 1 / 8 / 64, context 8k / 32k / 128k, bf16 (prefill: one 8k prompt);
- GQA and MLA prefill over an int8 / fp8_e4m3 cache (issue 39), the same prompt.
Every launch keeps its argument values, so the compile specialises them as Triton's JIT
does (`aot_cuda_check.jit_specialisation`).

`ALLOWED_SPILLS` names the production tiles that may spill, each with its reason; any
other spill fails the check.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

SMS = 132  # H200 SXM
BLOCK_SIZE = 64  # page size of the captured caches
BATCHES = (1, 8, 64)
CONTEXTS = (8192, 32768, 131072)
GQA_GROUPS = (8, 16, 64)
MLA_HEADS = (16, 128)
TOPK = 2048
INDEXER = (64, 128)  # heads x head dim
DCP_RANKS = 8
PREFILL_TOKENS = 8192
BF16 = torch.bfloat16
KV_QUANT = ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8_e4m3"))  # kv_cache_dtype of the quantised prefill rows

# (kernel, label substring, arch or None for both) -> why this production tile may spill.
# Empty: no production tile spills (the sparse MLA tile's entry went when its launcher
# took 8 warps, ops/sparse/triton_sparse_mla.py).
ALLOWED_SPILLS: dict[tuple[str, str, int | None], str] = {}


@dataclass
class ProductionLaunch:
    label: str  # the production shape that made it
    launch: Any  # core.triton_common.Launch
    values: dict[str, Any]  # kernel parameter -> the value the launcher passed

    @property
    def kernel_name(self) -> str:
        return self.launch.kernel.fn.__name__


def allowed_spill(kernel: str, label: str, arch: int) -> str | None:
    """The reason a spill of this production tile is accepted, or None."""
    for (name, part, only), reason in ALLOWED_SPILLS.items():
        if name == kernel and part in label and only in (None, arch):
            return reason
    return None


def _paged(B: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    nb = -(-ctx // BLOCK_SIZE)
    return (torch.zeros(B, nb, dtype=torch.int32), torch.arange(B + 1, dtype=torch.int32),
            torch.full((B,), ctx, dtype=torch.int32))


def _scales(bt: torch.Tensor, heads: int) -> torch.Tensor:
    """A quantised cache's fp32 row scales [pages, BLOCK_SIZE, heads], zero-stride like the pages."""
    return torch.empty(1, BLOCK_SIZE, heads).expand(bt.numel(), BLOCK_SIZE, heads)


def _gqa(group: int, T: int, B: int, ctx: int, kv_dtype: torch.dtype = BF16) -> tuple:
    bt, _, kv_lens = _paged(B, ctx)
    D = 128
    q = torch.empty(T, group, D, dtype=BF16)
    kv = torch.empty(1, BLOCK_SIZE, 1, D, dtype=kv_dtype).expand(bt.numel(), BLOCK_SIZE, 1, D)
    qsl = torch.linspace(0, T, B + 1).round().to(torch.int32)
    return q, kv, kv, bt, qsl, torch.full((T,), ctx, dtype=torch.int32), D ** -0.5


def _mla(heads: int, T: int, B: int, ctx: int, kv_dtype: torch.dtype = BF16) -> tuple:
    bt, _, _ = _paged(B, ctx)
    qn, qp = torch.empty(T, heads, 512, dtype=BF16), torch.empty(T, heads, 64, dtype=BF16)
    cache = torch.empty(1, BLOCK_SIZE, 576, dtype=kv_dtype).expand(bt.numel(), BLOCK_SIZE, 576)
    qsl = torch.linspace(0, T, B + 1).round().to(torch.int32)
    return qn, qp, cache, bt, qsl, torch.full((T,), ctx, dtype=torch.int32), 576 ** -0.5


def _calls() -> Iterator[tuple[str, Callable[[], Any]]]:
    from cp_compile.ops.merge import launch as merge_launch
    from cp_compile.ops.paged import launch as paged_launch
    from cp_compile.ops.sparse.triton_indexer import index_scores_triton
    from cp_compile.ops.sparse.triton_sparse_mla import sparse_mla_rows_triton

    for B in BATCHES:
        for ctx in CONTEXTS:
            for g in GQA_GROUPS:
                yield (f"GQA decode {g} q heads per KV head, D 128, batch {B}, {ctx // 1024}k",
                       lambda g=g, B=B, ctx=ctx: paged_launch.paged_attention_lse(*_gqa(g, B, B, ctx)))
            for h in MLA_HEADS:
                yield (f"MLA decode {h} heads 512+64, batch {B}, {ctx // 1024}k",
                       lambda h=h, B=B, ctx=ctx: paged_launch.mla_partial_attention(*_mla(h, B, B, ctx)))
        for h in MLA_HEADS:
            # The launcher's own CUDA choice (use_dot, tile, num_warps from target_of under planning_for).
            def sparse(h=h, B=B):
                qn, qp, cache, bt, qsl, _, scale = _mla(h, B, B, 32768)
                idx = torch.zeros(B, TOPK, dtype=torch.int32)
                return sparse_mla_rows_triton(qn, qp, cache, bt, torch.arange(B, dtype=torch.int32), idx, scale)
            yield f"sparse MLA top-{TOPK} {h} heads, batch {B}", sparse

        def indexer(B=B):
            hi, di = INDEXER
            bt, _, _ = _paged(B, 32768)
            cache = torch.empty(1, BLOCK_SIZE, di, dtype=BF16).expand(bt.numel(), BLOCK_SIZE, di)
            return index_scores_triton(torch.empty(B, hi, di, dtype=BF16), cache, torch.empty(B, hi, dtype=BF16), bt,
                                       torch.arange(B, dtype=torch.int32), torch.full((B,), 32768, dtype=torch.int32),
                                       use_dot=True)
        yield f"indexer {INDEXER[0]} x {INDEXER[1]}, batch {B}, 32k", indexer
        for heads, dv in [(g, 128) for g in GQA_GROUPS] + [(h, 512) for h in MLA_HEADS]:
            # All-to-all combine: each rank merges the 8 ranks' partials of its 1/8 of the heads;
            # LSE rescale: each rank scales all its heads by the gathered LSEs.
            share = max(heads // DCP_RANKS, 1)
            outs, lses = torch.empty(DCP_RANKS, B, share, dv, dtype=BF16), torch.empty(DCP_RANKS, B, share)
            yield (f"DCP merge {DCP_RANKS} ranks, {heads} heads Dv {dv}, batch {B}",
                   lambda o=outs, l=lses: merge_launch.lse_combine(o, l))
            own, own_lse = torch.empty(B, heads, dv, dtype=BF16), torch.empty(B, heads)
            gathered = torch.empty(DCP_RANKS * heads, B)
            yield (f"DCP LSE rescale {DCP_RANKS} ranks, {heads} heads Dv {dv}, batch {B}",
                   lambda o=own, l=own_lse, a=gathered: merge_launch.lse_rescale(o, l, a))
    for g in GQA_GROUPS:
        yield (f"GQA prefill {g} q heads per KV head, D 128, {PREFILL_TOKENS // 1024}k prompt",
               lambda g=g: paged_launch.paged_attention_lse(*_gqa(g, PREFILL_TOKENS, 1, PREFILL_TOKENS)))
    for h in MLA_HEADS:
        yield (f"MLA prefill {h} heads 512+64, {PREFILL_TOKENS // 1024}k prompt",
               lambda h=h: paged_launch.mla_partial_attention(*_mla(h, PREFILL_TOKENS, 1, PREFILL_TOKENS)))
    # Quantised caches (issue 39): the same prompt over int8 / fp8 pages and their fp32 row scales
    # (the query-tiled kernel's QUANT twin, `_paged_prefill_quant_kernel`).
    for kv_dtype, name in KV_QUANT:
        for g in GQA_GROUPS:
            def gqa_quant(g=g, kv_dtype=kv_dtype):
                args = _gqa(g, PREFILL_TOKENS, 1, PREFILL_TOKENS, kv_dtype)
                sc = _scales(args[3], 1)
                return paged_launch.paged_attention_lse(*args, sc, sc)
            yield f"GQA prefill {g} q heads per KV head, D 128, {name} cache, {PREFILL_TOKENS // 1024}k prompt", gqa_quant
        for h in MLA_HEADS:
            def mla_quant(h=h, kv_dtype=kv_dtype):
                args = _mla(h, PREFILL_TOKENS, 1, PREFILL_TOKENS, kv_dtype)
                return paged_launch.mla_partial_attention(*args, _scales(args[3], 1))
            yield f"MLA prefill {h} heads 512+64, {name} cache, {PREFILL_TOKENS // 1024}k prompt", mla_quant


def production_launches() -> list[ProductionLaunch]:
    """Every kernel launch of the production shapes, in the order the shapes are listed."""
    from cp_compile.ops.core.triton_common import capture_launches, planning_for

    found = []
    for label, call in _calls():
        with capture_launches() as launches, planning_for("cuda", SMS):
            call()
        for lc in launches:
            kwargs = {k: v for k, v in lc.kwargs.items() if k not in ("num_warps", "num_stages", "num_ctas")}
            values = dict(inspect.signature(lc.kernel.fn).bind(*lc.args, **kwargs).arguments)
            found.append(ProductionLaunch(label, lc, values))
    return found
