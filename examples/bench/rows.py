"""The JSON row of one measured config, and writing the rows."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

import torch

import cp_compile
from examples.bench.args import BenchArgs
from examples.bench.models import comm_bytes_per_step
from examples.bench.profile import CATEGORIES
from examples.bench.timing import summarize


def kv_budget(args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, batch: int,
              real_layers: int) -> dict[str, Any]:
    """Largest context that fits `args.kv_budget_gib` of KV per rank, with the shape's real layer count.

    Pages per rank = budget // bytes of one page (all layers); each page holds
    `block_size` tokens of a virtual block of `block_size * dcp`, so a request of
    the batch gets `pages // batch * block_size * dcp` tokens of context.
    """
    spec = dataclasses.replace(model.kv_cache_spec(), num_layers=real_layers)
    page = cp_compile.allocate_kv_cache(cfg, spec, 1, dtype=args.torch_dtype, device="meta")
    pages = int(args.kv_budget_gib * 2**30) // page.sharded_bytes
    return dict(kv_budget_gib=args.kv_budget_gib, kv_budget_layers=real_layers,
                kv_bytes_per_token_per_rank=page.sharded_bytes // cfg.block_size,
                kv_budget_tokens_per_rank=pages * cfg.block_size,
                kv_budget_max_context=pages // batch * cfg.block_size * cfg.decode_context_parallel_size)


def breakdown_fields(per_rank: list[dict[str, float]], num_layers: int) -> dict[str, Any]:
    """Per-step breakdown: mean over ranks of each rank's median over the profiled steps."""
    if not per_rank or not per_rank[0]:
        return dict(breakdown_ms={}, breakdown_ms_per_rank=[], collectives_per_layer={}, attention_ms=None)
    mean = {k: statistics.fmean(r[k] for r in per_rank) for k in ("step", *CATEGORIES)}
    return dict(breakdown_ms=mean, breakdown_ms_per_rank=per_rank,
                collectives_per_layer={"dcp": per_rank[0]["dcp_collectives"] / num_layers,
                                       "tp": per_rank[0]["tp_collectives"] / num_layers},
                attention_ms=mean["attention"])


def decode_row(args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, merge: str, context: int,
               batch: int, step_ms: list[float], used_blocks: int, pool: cp_compile.KVCache, graphs: int,
               recompiles: int, per_rank: list[dict[str, float]], real_layers: int,
               world: tuple[int, str]) -> dict[str, Any]:
    """One (dcp, merge, context, batch) decode config; step times are already the max over ranks.

    `world` is the (dcp, merge) world it ran in: a dcp = 1 row is the baseline timed
    alongside that world's DCP model.
    """
    dtype = args.torch_dtype
    # Right-sized shard for this config (the pages it used), measured off a meta allocation.
    used = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), used_blocks, dtype=dtype, device="meta")
    dcp_bytes, tp_bytes = comm_bytes_per_step(model, batch, args.tp, cfg.decode_context_parallel_size, cfg.dcp_merge, dtype)
    return dict(
        kind=args.model, tp=args.tp, dcp=cfg.decode_context_parallel_size, interleave=args.interleave, batch=batch, context_len=context,
        **summarize(step_ms),
        step_ms=step_ms,
        kv_cache_bytes_per_rank=used.sharded_bytes, max_context_tokens_per_rank=used.tokens_per_rank,
        kv_blocks_per_rank=used_blocks,
        pool_kv_cache_bytes_per_rank=pool.sharded_bytes, pool_tokens_per_rank=pool.tokens_per_rank,
        comm_bytes_per_step=dcp_bytes, tp_allreduce_bytes_per_step=tp_bytes,
        lowering=args.lowering, dtype=args.dtype, merge=merge, block_size=args.block_size,
        warmup=args.warmup, steps=args.steps, graphs_compiled=graphs, recompiled_in_timed_steps=recompiles > 0,
        device=str(pool.layers[0][0].device.type),
        shape=args.shape, world=list(world), num_layers=model.cfg.num_layers, recompiles_after_warmup=recompiles,
        profile_steps=args.profile_steps, **breakdown_fields(per_rank, model.cfg.num_layers),
        **kv_budget(args, model, cfg, batch, real_layers),
        compile_s_cp_ascend=None, compile_s_plain=None, compile_ratio=None, backend_s_cp_ascend=None,
        backend_s_plain=None, dcp_pass_s=None,
    )


def prefill_row(args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, merge: str, prompt: int,
                prefix: int, batch: int, step_ms: list[float], used_blocks: int, pool: cp_compile.KVCache,
                graphs: int, recompiles: int, per_rank: list[dict[str, float]], world: tuple[int, str]
                ) -> dict[str, Any]:
    """One (dcp, merge, prompt, cached prefix, batch) prefill config; step times are the max over ranks.

    `context_len` is the cached prefix (0: the whole prompt in one step), so that rows
    key like decode rows; `new_tokens` per request ran in the step.
    """
    dtype = args.torch_dtype
    new = prompt - prefix
    used = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), used_blocks, dtype=dtype, device="meta")
    # The decode traffic model is per query token, so a step of batch x new tokens sends that many tokens' worth.
    dcp_bytes, tp_bytes = comm_bytes_per_step(model, batch * new, args.tp, cfg.decode_context_parallel_size, cfg.dcp_merge, dtype)
    if cfg.enable_dsa_cp:  # its context-parallel traffic: the two all-to-alls per layer
        from examples.bench.dsa_cp import dsa_cp_comm_bytes_per_step

        dcp_bytes = dsa_cp_comm_bytes_per_step(model, batch * new, args.tp, dtype)
    if cfg.prefill_context_parallel_size > 1:  # PCP traffic is not modelled here: the profiler's dcp_comm (= PCP collectives) measures it
        dcp_bytes = None
    ttft = summarize(step_ms, "ttft")
    return dict(
        kind=args.model, shape=args.shape, tp=args.tp, dcp=cfg.decode_context_parallel_size, pcp=cfg.prefill_context_parallel_size, merge=merge, world=list(world),
        dsa_cp=cfg.enable_dsa_cp,
        interleave=args.interleave, block_size=args.block_size, batch=batch, variant="chunked" if prefix else "full",
        prompt_len=prompt, context_len=prefix, new_tokens=new, metric="ttft", **ttft, step_ms=step_ms,
        prefill_tokens_per_s=batch * new / ttft["ttft_ms"] * 1e3,
        kv_cache_bytes_per_rank=used.sharded_bytes, kv_blocks_per_rank=used_blocks,
        pool_kv_cache_bytes_per_rank=pool.sharded_bytes, comm_bytes_per_step=dcp_bytes,
        tp_allreduce_bytes_per_step=tp_bytes, lowering=args.lowering, dtype=args.dtype, warmup=args.warmup,
        steps=args.steps, graphs_compiled=graphs, recompiles_after_warmup=recompiles,
        recompiled_in_timed_steps=recompiles > 0, device=str(pool.layers[0][0].device.type),
        num_layers=model.cfg.num_layers, profile_steps=args.profile_steps,
        **breakdown_fields(per_rank, model.cfg.num_layers), compile_s_cp_ascend=None,
    )


def add_paired_ratios(rows: list[dict[str, Any]], key: str) -> None:
    """rows[0] is the dcp = 1 baseline of one world; every other row gets `key`: the
    median over steps of its step time / the baseline step run next to it (each
    pair ran back to back, so machine noise cancels better than in a ratio of medians)."""
    for r in rows:
        r[key] = None if r is rows[0] else statistics.median(b / a for a, b in zip(rows[0]["step_ms"], r["step_ms"]))


def merge_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (dcp, merge, context, batch): the steps of every pass pooled (`--repeat`).

    TPOT is recomputed over the pooled steps; the breakdown is the median over passes
    of each category; compile times are averaged over passes. A single pass is unchanged.
    """
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        # prompt_len: prefill rows of one cached prefix differ by prompt length (decode rows have none).
        groups.setdefault((*r["world"], r["dcp"], r["merge"], r["context_len"], r["batch"], r.get("prompt_len")),
                          []).append(r)
    out = []
    for rs in groups.values():
        if len(rs) == 1:
            out.append(rs[0])
            continue
        row = dict(rs[0])
        row["step_ms"] = [t for r in rs for t in r["step_ms"]]
        metric = row.get("metric", "tpot")
        row.update(summarize(row["step_ms"], metric))
        row["repeats"] = len(rs)
        row[f"{metric}_ms_per_pass"] = [r[f"{metric}_ms"] for r in rs]
        if rs[0].get(f"{metric}_ratio_paired") is not None:
            row[f"{metric}_ratio_paired"] = statistics.median(r[f"{metric}_ratio_paired"] for r in rs)
        for k in ("graphs_compiled", "recompiles_after_warmup"):
            row[k] = max(r[k] for r in rs)
        row["recompiled_in_timed_steps"] = any(r["recompiled_in_timed_steps"] for r in rs)
        if rs[0]["breakdown_ms"]:
            row["breakdown_ms"] = {k: statistics.median(r["breakdown_ms"][k] for r in rs) for k in rs[0]["breakdown_ms"]}
            row["breakdown_ms_per_rank"] = [x for r in rs for x in r["breakdown_ms_per_rank"]]
            row["attention_ms"] = row["breakdown_ms"]["attention"]
        if rs[0]["compile_s_cp_ascend"] is not None:
            # The fastest run of each side over the repeats (compile_probe says why).
            cp = min(r["compile_s_cp_ascend"] for r in rs)
            plain = min(r["compile_s_plain"] for r in rs)
            row.update({k: statistics.fmean(r[k] for r in rs) for k in ("backend_s_cp_ascend", "backend_s_plain",
                                                                         "dcp_pass_s")})
            row.update(compile_s_cp_ascend=cp, compile_s_plain=plain, compile_ratio=cp / plain,
                       compile_s_plain_runs=[x for r in rs for x in r["compile_s_plain_runs"]],
                       compile_s_cp_ascend_runs=[x for r in rs for x in r["compile_s_cp_ascend_runs"]])
        out.append(row)
    return out


def write_json(rows: list[dict[str, Any]], out: Path, name: str) -> Path:
    path = out / name
    path.write_text(json.dumps(rows, indent=1))
    return path


def pair_sides(rows: list[dict[str, Any]], args: Any, field: str, base: Any,
               other: Any) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(baseline row, other row) per (prompt, prefix, batch) of a two-sided prefill
    comparison in one world (`field` is "dsa_cp" or "pcp"), in sweep order."""
    by = {(r[field], r["prompt_len"], r["context_len"], r["batch"]): r for r in rows}
    out = []
    for prompt in args.prompt:
        for batch in args.batch:
            for prefix in args.chunks(prompt):
                a, b = by.get((base, prompt, prefix, batch)), by.get((other, prompt, prefix, batch))
                if a is not None and b is not None:
                    out.append((a, b))
    return out
