"""`bench_prefill --dsa-cp`: TTFT of an SFA model with DSA-CP on vs off, side by side in one world.

One world of `tp` ranks (dcp = 1) initialised with `enable_dsa_cp=True` holds two
sides of the same model (same weights, same process), stepped alternately like the
DCP benchmark's (`decode.alternate_steps`):

- side 0, DSA-CP off: the model compiled with the plain lowering (no cp pass: at
  dcp = 1 without DSA-CP cp_ascend has nothing to rewrite), every rank running the
  indexer for all T tokens and sparse MLA on its H / tp heads;
- side 1, DSA-CP on: `cp_compile.compile_model`, which compiles one graph per batch
  kind; a prefill step runs the "prefill" graph, where the `dsa_cp` pass shards the
  indexer's and sparse MLA's query rows over TP with two all-to-alls per layer.

Each side has its own KV pool. The JSON rows are the prefill rows of
`rows.prefill_row` plus `dsa_cp` (bool); `comm_bytes_per_step` of the DSA-CP side
is its all-to-all bytes (`dsa_cp_comm_bytes_per_step`), and `ttft_ratio_paired`
(on / off, median over paired steps) is on the DSA-CP row. The profiler counts the
row ops as attention and the all-to-alls under `dcp_comm` (the context-parallel
collectives).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import cp_compile
from examples.bench.args import PrefillArgs
from examples.bench.cache import world_geometry
from examples.bench.decode import PlainCompiled, Side, _CountingBackend
from examples.bench.launch import log
from examples.bench.rows import pair_sides
from examples.bench.profile import CATEGORIES
from examples.bench.shapes import ModelSource

WORLD = (1, "dsa_cp")  # (dcp, label) of the one DSA-CP world


def dsa_cp_comm_bytes_per_step(model: torch.nn.Module, num_tokens: int, tp: int, dtype: torch.dtype) -> int:
    """Bytes one rank sends per step in DSA-CP's two all-to-alls, all layers.

    Per layer: #1 sends (tp - 1) / tp of [T_pad, H/tp, L + R], #2 (tp - 1) / tp of
    [T_pad, H/tp, L]: (tp - 1) / tp^2 * T_pad * H * (2L + R) * bytes (docs/dsa_cp.md).
    """
    cfg = model.cfg
    t_pad = -(-num_tokens // tp) * tp
    nbytes = torch.empty(0, dtype=dtype).element_size()
    per_layer = (tp - 1) * t_pad * cfg.num_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim) * nbytes // tp**2
    return per_layer * cfg.num_layers


def init_dsa_cp_world(args: PrefillArgs, device: torch.device) -> Any:
    """`init_parallel` at tp = world size, dcp = 1, enable_dsa_cp (the DSA-CP side's config)."""
    cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, block_size=args.block_size, enable_dsa_cp=True)
    return cp_compile.init_parallel(cfg, device=device)


def build_dsa_cp_sides(rank: int, world_size: int, args: PrefillArgs, source: ModelSource, state: Any,
                       device: torch.device, tokens_per_req: int) -> tuple[torch.nn.Module, list[Side]]:
    """The model on this rank; side 0 DSA-CP off (plain lowering), side 1 on (cp_ascend)."""
    t0 = time.perf_counter()
    model = source.build(world_size, state.layout.tp.rank, state.tp_group)
    for p in model.parameters():  # parameters only: the rope inverse frequencies stay fp32 (as in HF)
        p.data = p.data.to(device=device, dtype=args.torch_dtype)
    model.to(device)
    sides = []
    for cfg in (cp_compile.CPConfig(tensor_parallel_size=args.tp, block_size=args.block_size), state.cfg):
        geom = world_geometry(args.block_size, 1, tokens_per_req, max(args.batch), 0)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), geom.num_blocks, dtype=args.torch_dtype,
                                             device=device, attention=model.attention_spec())
        if cfg.enable_dsa_cp:
            compiled = cp_compile.compile_model(model, lowering=args.lowering)

            def graphs(c: Any = compiled) -> int:  # one per batch kind once both ran; more = recompiles
                return sum(len(b.pass_managers) for b in c.backends.values())

            sides.append(Side(cfg, "dsa_cp", 0, cache, geom, compiled, graphs))
        else:
            backend = _CountingBackend(args.lowering)
            sides.append(Side(cfg, "none", 0, cache, geom, PlainCompiled(model.forward, backend),
                              lambda b=backend: b.graphs))
    log(rank, f"[dsa_cp] {args.shape} tp={args.tp}: model built in {time.perf_counter() - t0:.1f} s; pool "
              f"{sides[0].geom.num_blocks} pages x {args.block_size} tokens/rank per side; compiling with "
              f"{args.lowering}")
    return model, sides


def format_dsa_cp_table(rows: list[dict[str, Any]], args: PrefillArgs) -> str:
    """One line per (prompt, prefix, batch): TTFT off / on, their ratio, the paired ratio,
    attention-op time (profiled) on / off, the all-to-all bytes, graphs per side."""
    head = (f"{'prompt':>7} {'prefix':>7} {'batch':>5} {'TTFT off':>10} {'TTFT on':>10} {'on/off':>6} "
            f"{'paired':>6} {'attn off':>9} {'attn on':>9} {'a2a B/step':>13} {'graphs off/on':>13}")
    lines = [head, "-" * len(head)]
    for off, on in pair_sides(rows, args, "dsa_cp", False, True):
        attn = (f"{off['attention_ms']:>7.1f}ms {on['attention_ms']:>7.1f}ms" if off["attention_ms"] is not None
                else f"{'-':>9} {'-':>9}")
        paired = on.get("ttft_ratio_paired")
        lines.append(f"{on['prompt_len']:>7} {on['context_len']:>7} {on['batch']:>5} {off['ttft_ms']:>8.1f}ms "
                     f"{on['ttft_ms']:>8.1f}ms {on['ttft_ms'] / off['ttft_ms']:>6.2f} "
                     f"{paired if paired is None else f'{paired:.2f}':>6} {attn} {on['comm_bytes_per_step']:>13,} "
                     f"{off['graphs_compiled']:>6}/{on['graphs_compiled']:<6}")
    return "\n".join(lines)


def format_dsa_cp_breakdown(rows: list[dict[str, Any]], args: PrefillArgs) -> str:
    """The profiled prefill step of each side: ms per category (mean over ranks)."""
    if not any(r["breakdown_ms"] for r in rows):
        return "(no profile: --profile-steps 0)"
    head = (f"{'prompt':>7} {'prefix':>7} {'batch':>5} {'DSA-CP':>6} {'step':>9} "
            + " ".join(f"{c:>9}" for c in CATEGORIES) + f" {'CP coll/layer':>13} {'TP coll/layer':>13}")
    lines = [f"profiled prefill step (ms, median of {args.profile_steps} steps per rank, mean over ranks; "
             f"dcp_comm = the DSA-CP all-to-alls)", head, "-" * len(head)]
    for pair in pair_sides(rows, args, "dsa_cp", False, True):
        for r in pair:
            bd, cpl = r["breakdown_ms"], r["collectives_per_layer"]
            if bd:
                lines.append(f"{r['prompt_len']:>7} {r['context_len']:>7} {r['batch']:>5} "
                             f"{'on' if r['dsa_cp'] else 'off':>6} {bd['step']:>9.1f} "
                             + " ".join(f"{bd[c]:>9.1f}" for c in CATEGORIES)
                             + f" {cpl['dcp']:>13g} {cpl['tp']:>13g}")
    return "\n".join(lines)


def plot_dsa_cp(rows: list[dict[str, Any]], args: PrefillArgs, path: Path) -> Path:
    """TTFT vs prompt length (off solid, on dashed, per variant and batch) and the profiled
    step's breakdown per (prompt, variant, off / on) for the largest batch."""
    from examples.bench.plot import _shape, prefill_figure, side_lines

    batch = max(args.batch)
    bars = sorted((r for r in rows if r["batch"] == batch and r["breakdown_ms"]),
                  key=lambda r: (r["prompt_len"], r["context_len"], r["dsa_cp"]))
    return prefill_figure(
        args, path, lines=side_lines(rows, args, "dsa_cp", (False, True), lambda on: f"DSA-CP {'on' if on else 'off'}"),
        bars=bars, bar_label=lambda r: f"{r['prompt_len']}\n{r['variant']}\n{'on' if r['dsa_cp'] else 'off'}",
        ttft_title="Time to first token, DSA-CP on vs off",
        bars_title=f"Where the prefill step goes (torch profiler), batch {batch}",
        suptitle=f"Prefill, DSA-CP vs TP: {_shape(args)}, tp={args.tp}, {args.lowering}, {args.dtype}, "
                 f"block={args.block_size}")
