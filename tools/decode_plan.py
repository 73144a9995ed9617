"""The decode attention launches at production shapes, and a predicted bandwidth (issue 36).

`python -m tools.device_check --plan --json FILE` (or `python -m tools.decode_plan`):
the launches the registered paged decode kernels (`cp::paged_attention_lse`,
`cp::mla_partial_attention`) make for CUDA with 132 SMs (an H200), captured from the
real launchers on CPU tensors (`capture_launches` + `planning_for`: nothing runs, the
caches are zero-stride views, so 128k contexts cost no memory), and beside them the
unsplit launch main had before (one program per (token, KV head, head block), grid
capped at the SM count, broadcast product). Per launch: grid, constexprs, bytes read,
waves on 132 SMs, and a PREDICTION of the fraction of 4.8 TB/s under the model of
docs/kernels.md ("Split-KV decode: plan and model"); nothing here is a measurement.
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from pathlib import Path
from typing import Any

import torch

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e peak
SMS = 132  # H200 SXM
STREAM_EFFICIENCY = 0.85  # assumed share of an SM's fair bandwidth a busy streaming program reaches
# ASSUMED, not measured: the L2 bandwidth all SMs together get on rows another program just
# pulled from HBM (twice HBM's; the device check's bandwidth step is what would tell).
L2_BYTES_PER_S = 2 * HBM_BYTES_PER_S
TENSOR_FLOPS = 989e12  # H200 SXM dense bf16 tensor-core peak (spec sheet)
DOT_EFFICIENCY = 0.6  # ASSUMED share of that peak a Triton tl.dot tile of 16-32 rows reaches
BLOCK_SIZE = 64  # page size of the plan's caches (vLLM's CUDA default is 16; the split lengths do not depend on it)
BYTES = 2  # bf16

GQA_GROUPS = (8, 16, 64)  # query heads per KV head, one KV head per rank (TP'd), D 128
MLA_HEADS = (16, 128)
BATCHES = (1, 8, 64)
CONTEXTS = (8192, 32768, 131072)

_DRAM_PER_SM = HBM_BYTES_PER_S / SMS * STREAM_EFFICIENCY
_L2_PER_SM = L2_BYTES_PER_S / SMS
_FLOPS_PER_SM = TENSOR_FLOPS / SMS * DOT_EFFICIENCY


def _schedule(costs: list[float], sms: int) -> float:
    """Makespan of programs issued in id order to the SM that frees first (one resident
    program per SM: pessimistic where two would fit)."""
    free = [0.0] * min(sms, max(len(costs), 1))
    heapq.heapify(free)
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free) if costs else 0.0


def _attention_programs(launch: Any, ctx: int, D: int, Dv: int) -> tuple[list[float], list[float]]:
    """(seconds, HBM bytes) of each program of a `_paged_attention_lse_kernel` launch.

    A work item (token, KV head, split, head block) reads the K and V rows of its split's
    keys (every request at full context; MLA: the latent + rope row once, as K and V) and
    its q tile. The n_hblk head blocks of one split are neighbours in the grid (the head
    block is the innermost index), resident together: the split's rows come from HBM
    once for them, each block's share 1/n_hblk, and every block reads all of them through
    L2. An item lasts max(HBM bytes / an SM's HBM share, L2 bytes / its L2 share, tl.dot
    flops / its tensor share); a persistent program sums the items it strides over."""
    n_work, n_hblk, n_splits, split_len = (launch.arg(n) for n in ("n_work", "n_hblk", "n_splits", "split_len"))
    block_h, use_dot = launch.kwargs["BLOCK_H"], launch.kwargs["USE_DOT"]
    grid = launch.grid[0]
    row = D if launch.kwargs["DR_PAD"] else D + Dv  # MLA (DR_PAD > 0) reads the latent row once, as K and V
    seconds, dram = [0.0] * grid, [0.0] * grid
    for w in range(n_work):
        sp = (w // n_hblk) % n_splits
        keys = max(0, min(split_len, ctx - sp * split_len))
        rows = keys * row * BYTES
        hbm = rows / n_hblk + block_h * D * BYTES
        flops = 2 * block_h * keys * (D + Dv) if use_dot else 0  # padded head rows count: the dot computes them
        seconds[w % grid] += max(hbm / _DRAM_PER_SM, rows / _L2_PER_SM, flops / _FLOPS_PER_SM)
        dram[w % grid] += hbm
    return seconds, dram


def _merge_program_bytes(launch: Any) -> list[float]:
    """Bytes each program of a split merge launch moves (the paged `_split_merge_kernel` and the
    sparse `_sparse_split_merge_kernel`): per row block and Dv block, every split's fp32 partial
    and LSE in, the output and the LSE out."""
    n_splits, n_rows, Dv, n_dblk = (launch.arg(n) for n in ("n_splits", "n_rows", "Dv", "n_dblk"))
    block_r, block_d, grid = launch.kwargs["BLOCK_R"], launch.kwargs["BLOCK_D"], launch.grid[0]
    costs = [0.0] * grid
    for w in range(-(-n_rows // block_r) * n_dblk):
        rows = min(block_r, n_rows - (w // n_dblk) * block_r)
        cols = min(block_d, Dv - (w % n_dblk) * block_d)
        costs[w % grid] += rows * (n_splits * (cols + 1) * 4 + cols * BYTES + 4)
    return costs


def _inputs(kind: str, heads: int, B: int, ctx: int) -> tuple[tuple, int, int, int]:
    """Launcher arguments (CPU, zero-stride caches) and (D, Dv, unique KV bytes)."""
    nb = ctx // BLOCK_SIZE
    bt = torch.zeros(B, nb, dtype=torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32)
    kv_lens = torch.full((B,), ctx, dtype=torch.int32)
    if kind == "GQA":
        D = Dv = 128
        q = torch.empty(B, heads, D, dtype=torch.bfloat16)
        kv = torch.empty(1, BLOCK_SIZE, 1, D, dtype=torch.bfloat16).expand(B * nb, BLOCK_SIZE, 1, D)
        return (q, kv, kv, bt, qsl, kv_lens, D ** -0.5), D, Dv, B * ctx * 2 * D * BYTES
    L, R = 512, 64
    q = torch.empty(B, heads, L + R, dtype=torch.bfloat16)
    cache = torch.empty(1, BLOCK_SIZE, L + R, dtype=torch.bfloat16).expand(B * nb, BLOCK_SIZE, L + R)
    return ((q, cache.unsqueeze(2), cache[..., :L].unsqueeze(2), bt, qsl, kv_lens, 0.1), L + R, L,
            B * ctx * (L + R) * BYTES)


def plan_rows() -> list[dict[str, Any]]:
    from cp_compile.ops.core.triton_common import capture_launches, planning_for
    from cp_compile.ops.paged import launch as paged_launch
    from cp_compile.ops.paged.triton_decode import paged_attention_with_lse_triton

    rows: list[dict[str, Any]] = []
    shapes = [("GQA", g) for g in GQA_GROUPS] + [("MLA", h) for h in MLA_HEADS]
    for kind, heads in shapes:
        for B in BATCHES:
            for ctx in CONTEXTS:
                args, D, Dv, unique = _inputs(kind, heads, B, ctx)
                variants = {
                    # main before issue 36: unsplit, grid capped at the SMs, broadcast product
                    "before": lambda: paged_attention_with_lse_triton(*args, num_splits=1, use_dot=False,
                                                                      num_programs=SMS),
                    # what the registered kernel launches now
                    "split": lambda: paged_launch.paged_attention_lse(*args),
                }
                for variant, call in variants.items():
                    with capture_launches() as launches, planning_for("cuda", SMS):
                        call()
                    total_s, launch_rows = 0.0, []
                    for lc in launches:
                        name = lc.kernel.fn.__name__
                        if name == "_paged_attention_lse_kernel":
                            times, costs = _attention_programs(lc, ctx, D, Dv)
                        else:
                            costs = _merge_program_bytes(lc)
                            times = [c / _DRAM_PER_SM for c in costs]
                        seconds = _schedule(times, SMS)
                        total_s += seconds
                        launch_rows.append({
                            "kernel": name, "grid": list(lc.grid), "constexprs": dict(lc.kwargs),
                            "bytes_read": int(sum(costs)), "bytes_per_program_max": int(max(costs)),
                            "waves": round(lc.grid[0] / SMS, 2), "predicted_us": round(seconds * 1e6, 1)})
                    att = launch_rows[0]
                    rows.append({
                        "shape": f"{kind} {heads} heads" + (" per KV head, D 128" if kind == "GQA" else ", 512+64"),
                        "batch": B, "context": ctx, "variant": variant,
                        "splits": launches[0].arg("n_splits"), "head_blocks": launches[0].arg("n_hblk"),
                        "block_h": launches[0].kwargs["BLOCK_H"],
                        "split_len": launches[0].arg("split_len") if launches[0].arg("n_splits") > 1 else ctx,
                        "grid": att["grid"][0], "waves": att["waves"], "bytes_per_program": att["bytes_per_program_max"],
                        "unique_kv_bytes": unique,
                        "predicted_fraction_of_4.8TBps": round(unique / (total_s * HBM_BYTES_PER_S), 3),
                        "launches": launch_rows})
    return rows


# ----------------------------------------------------------------------------- sparse MLA and the indexer
# (docs/kernels.md "Split-KV sparse MLA and indexer"): the same capture and model.

SPARSE_TOPK = 2048  # DeepSeek-V3.2's selected tokens per query row
SPARSE_HEADS = (16, 128)  # local heads of 512 + 64 (tp 8 .. 1)
INDEXER_HEADS, INDEXER_DIM = 64, 128


def _sparse_mla_program_bytes(launch: Any, l2_reuse: bool) -> list[float]:
    """Bytes each program of a `_sparse_mla_kernel` launch moves: per item (row, split,
    head block) its split's latent rows (576 bf16 + the int32 index) and its q tile, and
    the partial it writes (fp32 with splits, bf16 out without). l2_reuse: the head blocks
    after the first of a (row, split) find its rows in L2 (they run side by side: the head
    block is the innermost item index)."""
    n_work, H, n_hblk, n_splits, split_len, K, L, R = (
        launch.arg(n) for n in ("n_work", "H", "n_hblk", "n_splits", "split_len", "K", "L", "R"))
    block_h, grid = launch.kwargs["BLOCK_H"], launch.grid[0]
    heads = [min(block_h, H - hb * block_h) for hb in range(n_hblk)]
    part = 4 if n_splits > 1 else BYTES
    costs = [0.0] * grid
    for w in range(n_work):
        hb, sp = w % n_hblk, (w // n_hblk) % n_splits
        keys = max(0, min(split_len, K - sp * split_len))
        rows = 0 if l2_reuse and hb > 0 else keys * ((L + R) * BYTES + 4)
        costs[w % grid] += rows + heads[hb] * ((L + R) * BYTES + L * part + 4)
    return costs


def _indexer_program_bytes(launch: Any, l2_reuse: bool) -> list[float]:
    """Bytes each program of an `_index_scores_kernel` launch moves: per item (row, key
    split) its keys (128 bf16) and their fp32 scores, and the row's q [64, 128] and weights,
    loaded once per item (before the splits: once per 64-key tile). l2_reuse: only a row's
    first item reads q from DRAM (16 KB, shared by all its items)."""
    n_work, n_splits, split_len, Hi, Di, S = (launch.arg(n) for n in ("n_work", "n_splits", "split_len", "Hi", "Di", "S"))
    grid = launch.grid[0]
    costs = [0.0] * grid
    for w in range(n_work):
        sp = w % n_splits
        keys = max(0, min(split_len, S - sp * split_len))
        costs[w % grid] += keys * (Di * BYTES + 4) + (0 if l2_reuse and sp else Hi * Di * BYTES + Hi * 4)
    return costs


def sparse_plan_rows() -> list[dict[str, Any]]:
    """Sparse MLA (top-2048, 16 / 128 heads of 512 + 64) and the lightning indexer (64 x
    128) at batch 1 / 8 / 64 and 8k-128k, before (main's launch: one program per (row, head
    block) over the whole list / per 64-key tile, grid capped at 132) and with the splits."""
    from cp_compile.ops.core.triton_common import capture_launches, planning_for
    from cp_compile.ops.sparse.triton_indexer import index_scores_triton
    from cp_compile.ops.sparse.triton_sparse_mla import sparse_mla_rows_triton

    L, R = 512, 64
    rows: list[dict[str, Any]] = []
    cases = [("sparse MLA", h) for h in SPARSE_HEADS] + [("indexer", INDEXER_HEADS)]
    for kind, heads in cases:
        for B in BATCHES:
            for ctx in CONTEXTS:
                nb = ctx // BLOCK_SIZE
                bt = torch.zeros(B, nb, dtype=torch.int32)
                req = torch.arange(B, dtype=torch.int32)
                if kind == "sparse MLA":
                    cache = torch.empty(1, BLOCK_SIZE, L + R, dtype=torch.bfloat16).expand(B * nb, BLOCK_SIZE, L + R)
                    args = (torch.empty(B, heads, L, dtype=torch.bfloat16), torch.empty(B, heads, R, dtype=torch.bfloat16),
                            cache, bt, req, torch.zeros(B, SPARSE_TOPK, dtype=torch.int32), 0.1)
                    unique = B * SPARSE_TOPK * (L + R) * BYTES
                    variants = {"before": lambda: sparse_mla_rows_triton(*args, num_splits=1, num_programs=SMS,
                                                                         block_n=32),
                                "split": lambda: sparse_mla_rows_triton(*args)}
                    shape = f"sparse MLA {heads} heads, 512+64, top-{SPARSE_TOPK}"
                else:
                    cache = torch.empty(1, BLOCK_SIZE, INDEXER_DIM, dtype=torch.bfloat16).expand(
                        B * nb, BLOCK_SIZE, INDEXER_DIM)
                    args = (torch.empty(B, heads, INDEXER_DIM, dtype=torch.bfloat16), cache,
                            torch.empty(B, heads), bt, req, torch.full((B,), ctx, dtype=torch.int32))
                    unique = B * ctx * (INDEXER_DIM * BYTES + 4)
                    variants = {"before": lambda: index_scores_triton(*args, num_splits=ctx // 64, num_programs=SMS,
                                                                        block_n=64),
                                "split": lambda: index_scores_triton(*args)}
                    shape = f"indexer {heads} heads x {INDEXER_DIM}"
                for variant, call in variants.items():
                    with capture_launches() as launches, planning_for("cuda", SMS):
                        call()
                    fractions = {}
                    for l2 in (False, True):
                        total_s, launch_rows = 0.0, []
                        for lc in launches:
                            name = lc.kernel.fn.__name__
                            costs = (_sparse_mla_program_bytes(lc, l2) if name == "_sparse_mla_kernel"
                                     else _indexer_program_bytes(lc, l2) if name == "_index_scores_kernel"
                                     else _merge_program_bytes(lc))
                            seconds = _schedule(costs, SMS) / (HBM_BYTES_PER_S / SMS * STREAM_EFFICIENCY)
                            total_s += seconds
                            launch_rows.append({
                                "kernel": name, "grid": list(lc.grid), "constexprs": dict(lc.kwargs),
                                "bytes_moved": int(sum(costs)), "bytes_per_program_max": int(max(costs)),
                                "waves": round(lc.grid[0] / SMS, 2), "predicted_us": round(seconds * 1e6, 1)})
                        fractions[l2] = round(unique / (total_s * HBM_BYTES_PER_S), 3)
                        if not l2:
                            no_reuse_rows = launch_rows
                    a = launches[0].args
                    splits = a[12] if kind == "sparse MLA" else a[8]
                    att = no_reuse_rows[0]
                    rows.append({
                        "shape": shape, "batch": B, "context": ctx, "variant": variant,
                        "splits": splits, "split_len": a[13] if kind == "sparse MLA" else a[9],
                        "grid": att["grid"][0], "waves": att["waves"], "bytes_per_program": att["bytes_per_program_max"],
                        "unique_kv_bytes": unique,
                        "predicted_fraction_of_4.8TBps": fractions[False],
                        "predicted_fraction_l2_reuse": fractions[True],
                        "launches": no_reuse_rows})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    keys = ["shape", "batch", "context", "variant", "splits", "block_h", "head_blocks", "grid", "waves",
            "bytes_per_program",
            "predicted_fraction_of_4.8TBps"]
    out = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    # the sparse rows have no paged head blocks: their cells stay blank
    out += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table")
    a = p.parse_args(argv)
    rows = plan_rows() + sparse_plan_rows()
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))
    print(markdown(rows) if a.markdown or not a.json else f"wrote {len(rows)} rows to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
