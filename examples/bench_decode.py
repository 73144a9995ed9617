"""Decode benchmark in graph mode: TP baseline (dcp = 1) vs DCP at the same world size (DESIGN.md §9).

For each DCP size one world of `--tp` ranks builds the TP-sharded example model,
compiles it once with the cp_ascend backend and sweeps context length x batch:

- the KV pool is allocated once per world, big enough for the largest config, so
  the cache tensors (graph inputs) keep their shapes across configs; the block
  table width is fixed per world for the same reason;
- the context is filled directly: random K/V (or latents) are written into this
  rank's cache shard with `cp::cache_write` through the DCP-local slot mapping of
  the context tokens, so decode attends over `context` cached tokens without a
  long prefill on CPU;
- `--warmup` decode steps (which absorb any recompile for a new batch size), then
  `--steps` timed decode steps of `batch` requests, one new token each, positions
  advancing. Each step is bracketed by barriers; a step's time is the max over
  ranks and TPOT is the median over steps.

Writes `<out>/bench_decode.json` (one row per (dcp, context, batch)) and
`<out>/bench_decode.png`, and prints a comparison table.

    python examples/bench_decode.py --tp 2 --dcp 1,2 --context 256,1024,4096 --batch 1,4
    torchrun --nproc-per-node=2 examples/bench_decode.py --tp 2 --dcp 1,2

Without torchrun the script spawns its own gloo ranks (`run_on_ranks`); under
torchrun (env RANK set) every process runs the same per-rank code directly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed as dist

try:
    import examples.models  # noqa: F401
except ImportError:  # `python examples/bench_decode.py` puts examples/, not the repo root, on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cp_compile  # noqa: E402
from cp_compile.comm_stats import decode_comm_bytes_per_layer  # noqa: E402
from cp_compile.ops import layout  # noqa: E402
from cp_compile.testing.multirank import run_on_ranks  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# --------------------------------------------------------------------------- arguments


@dataclass(frozen=True)
class BenchArgs:
    """Everything a rank needs (picklable: shipped to spawned ranks)."""

    model: str
    tp: int
    dcp: tuple[int, ...]
    context: tuple[int, ...]
    batch: tuple[int, ...]
    interleave: int
    block_size: int
    steps: int
    warmup: int
    lowering: str
    merge: str
    out: str
    dtype: str

    @property
    def decode_steps(self) -> int:
        return self.warmup + self.steps


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parse_args(argv: Sequence[str] | None = None) -> BenchArgs:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=("qwen3", "mla"), default="qwen3",
                   help="tiny Qwen3 (GQA, 1 KV head) or DeepSeek MLA (no q_lora)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size = world size")
    p.add_argument("--dcp", type=_int_list, default=(1, 2),
                   help="DCP sizes to compare; 1 (the TP baseline) is always included")
    p.add_argument("--context", type=_int_list, default=(256, 1024, 4096), help="cached context lengths")
    p.add_argument("--batch", type=_int_list, default=(1, 4), help="decode batch sizes")
    p.add_argument("--interleave", type=int, default=1, help="cp_kv_cache_interleave_size")
    p.add_argument("--block-size", type=int, default=16, help="per-rank KV page size (tokens)")
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per config")
    p.add_argument("--warmup", type=int, default=2, help="untimed decode steps per config")
    p.add_argument("--lowering", choices=("inductor", "aot_eager"), default="inductor")
    p.add_argument("--merge", choices=("ag_rs", "a2a"), default="ag_rs", help="DCP LSE merge")
    p.add_argument("--out", default="results/bench_decode", help="output directory")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    # The baseline goes first: its world also checks the model builds at this tp.
    dcp = tuple(sorted(set(a.dcp) | {1}))
    bad = [d for d in dcp if a.tp % d]
    if bad:
        p.error(f"--dcp {bad} must divide --tp {a.tp}")
    return BenchArgs(model=a.model, tp=a.tp, dcp=dcp, context=tuple(sorted(set(a.context))),
                     batch=tuple(sorted(set(a.batch))), interleave=a.interleave, block_size=a.block_size,
                     steps=a.steps, warmup=a.warmup, lowering=a.lowering, merge=a.merge, out=a.out,
                     dtype=a.dtype)


# --------------------------------------------------------------------------- model


def build_hf_model(kind: str, tp: int) -> Any:
    """The tiny HF model with enough query heads for `tp` (2 per rank, at least 4).

    Qwen3 keeps a single KV head so that any dcp dividing tp is valid for GQA
    (DCP ranks must share KV heads: dcp | tp // num_kv_heads).
    """
    from examples.models.tiny import hf_deepseek_v3, hf_qwen3

    heads = max(4, 2 * tp)
    if kind == "qwen3":
        return hf_qwen3(num_kv_heads=1, num_heads=heads)
    return hf_deepseek_v3(q_lora_rank=None, num_heads=heads)


def _attention_dims(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """(query heads per rank, q dim on the wire, v dim on the wire, hidden size).

    GQA gathers q [T, H, D] and merges out [T, H, D]; absorbed MLA gathers q_nope
    [T, H, L] and q_pe [T, H, R] and merges latent outputs [T, H, L].
    """
    cfg = model.cfg
    heads = cfg.num_heads // model.tp_size
    if hasattr(cfg, "kv_lora_rank"):
        return heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank, cfg.hidden_size
    return heads, cfg.head_dim, cfg.head_dim, cfg.hidden_size


def comm_bytes_per_step(model: torch.nn.Module, batch: int, tp: int, dcp: int, merge: str,
                        dtype: torch.dtype) -> tuple[int, int]:
    """Bytes one rank sends per decode step: (DCP attention traffic, TP all-reduce traffic).

    The TP all-reduces (o_proj and MLP down projection, two per layer, ring
    algorithm as `CollectiveMeter` counts them) are the same at every dcp.
    """
    heads, q_dim, v_dim, hidden = _attention_dims(model)
    nbytes = torch.empty(0, dtype=dtype).element_size()
    layers = model.cfg.num_layers
    dcp_bytes = decode_comm_bytes_per_layer(batch, heads, q_dim, v_dim, nbytes, dcp, merge) * layers
    tp_bytes = 2 * layers * (2 * batch * hidden * nbytes * (tp - 1) // tp)
    return dcp_bytes, tp_bytes


# --------------------------------------------------------------------------- per-rank work


@dataclass(frozen=True)
class WorldGeometry:
    """KV pool shapes fixed for a whole world, so configs do not change graph inputs."""

    num_blocks: int  # per-rank pages in the pool
    max_blocks_per_req: int  # block-table width


def world_geometry(args: BenchArgs, dcp: int) -> WorldGeometry:
    """Pages for the largest (context, batch) config plus a little slack."""
    vbs = args.block_size * dcp
    blocks_per_req = math.ceil((max(args.context) + args.decode_steps) / vbs)
    return WorldGeometry(num_blocks=max(args.batch) * blocks_per_req + 2, max_blocks_per_req=blocks_per_req)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _log(rank: int, msg: str) -> None:
    if rank == 0:
        print(msg, flush=True)


def fill_context(cache: cp_compile.KVCache, cfg: cp_compile.CPConfig, dcp_rank: int, alloc: cp_compile.BlockAllocator,
                 context: int, batch: int, device: torch.device, seed: int) -> None:
    """Write `context` random tokens of each of `batch` requests into this rank's shard.

    The global slot mapping of a (0, context) prefill is localised exactly as the
    DCP pass does it, so each rank stores only the tokens it owns, at the slots the
    decode steps will read.
    """
    meta = cp_compile.build_attention_metadata([(0, context)] * batch, alloc)
    slots = layout.local_slot_mapping(meta.slot_mapping, cfg.block_size, cfg.dcp, dcp_rank,
                                      cfg.interleave).to(device)
    g = torch.Generator(device=device).manual_seed(seed)
    for layer in cache.layers:
        for t in layer:
            new = torch.randn(slots.shape[0], *t.shape[2:], generator=g, device=device, dtype=torch.float32)
            torch.ops.cp.cache_write(new.to(t.dtype), t, slots)


def timed_decode(compiled: Any, cache: cp_compile.KVCache, alloc: cp_compile.BlockAllocator, context: int,
                 batch: int, args: BenchArgs, geom: WorldGeometry, vocab: int, device: torch.device
                 ) -> tuple[list[float], bool]:
    """Warm-up then timed decode steps.

    Returns each timed step's time in ms (max over ranks) and whether a graph was
    compiled during the timed steps (its compile time would then be in the TPOT).
    """
    times = []
    graphs_after_warmup = len(compiled.backend.pass_managers)
    g = torch.Generator().manual_seed(context * 131 + batch)
    for step in range(args.decode_steps):
        if step == args.warmup:
            graphs_after_warmup = len(compiled.backend.pass_managers)
        # Metadata and inputs are built outside the timed region: the runtime's job, not the model's.
        meta = cp_compile.build_attention_metadata([(context + step, 1)] * batch, alloc,
                                                   max_blocks_per_req=geom.max_blocks_per_req, device=device)
        ids = torch.randint(0, vocab, (batch,), generator=g).to(device)
        dist.barrier()
        t0 = time.perf_counter()
        with torch.no_grad():
            compiled(ids, meta.positions, cache.layers, meta)
        _sync(device)
        elapsed = (time.perf_counter() - t0) * 1e3
        dist.barrier()
        if step >= args.warmup:
            times.append(elapsed)
    # The slowest rank sets the step time.
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    recompiled = torch.tensor([len(compiled.backend.pass_managers) > graphs_after_warmup], dtype=torch.int32,
                              device=device)
    dist.all_reduce(recompiled, op=dist.ReduceOp.MAX)
    return t.tolist(), bool(recompiled.item())


def _config_row(args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, context: int, batch: int,
                step_ms: list[float], used_blocks: int, pool: cp_compile.KVCache, graphs: int,
                recompiled: bool) -> dict[str, Any]:
    dtype = DTYPES[args.dtype]
    # Right-sized shard for this config (the pages it used), measured off a meta allocation.
    used = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), used_blocks, dtype=dtype, device="meta")
    dcp_bytes, tp_bytes = comm_bytes_per_step(model, batch, args.tp, cfg.dcp, args.merge, dtype)
    return dict(
        kind=args.model, tp=args.tp, dcp=cfg.dcp, interleave=args.interleave, batch=batch, context_len=context,
        tpot_ms=statistics.median(step_ms), tpot_min_ms=min(step_ms), tpot_mean_ms=statistics.fmean(step_ms),
        step_ms=step_ms,
        kv_cache_bytes_per_rank=used.sharded_bytes, max_context_tokens_per_rank=used.tokens_per_rank,
        kv_blocks_per_rank=used_blocks,
        pool_kv_cache_bytes_per_rank=pool.sharded_bytes, pool_tokens_per_rank=pool.tokens_per_rank,
        comm_bytes_per_step=dcp_bytes, tp_allreduce_bytes_per_step=tp_bytes,
        lowering=args.lowering, dtype=args.dtype, merge=args.merge, block_size=args.block_size,
        warmup=args.warmup, steps=args.steps, graphs_compiled=graphs, recompiled_in_timed_steps=recompiled,
        device=str(pool.layers[0][0].device.type),
    )


def run_world(rank: int, world: int, args: BenchArgs, dcp: int, hf_config: Any,
              state_dict: dict[str, torch.Tensor], device: torch.device) -> list[dict[str, Any]]:
    """One DCP size on an initialised world: compile once, sweep (context, batch)."""
    from examples.models.tiny import example_from_config

    cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, decode_context_parallel_size=dcp,
                              cp_kv_cache_interleave_size=args.interleave, block_size=args.block_size,
                              dcp_merge=args.merge)
    state = cp_compile.init_parallel(cfg, device=device)
    try:
        dtype = DTYPES[args.dtype]
        model = example_from_config(hf_config, state_dict, world, state.tp_rank, state.tp_group)
        # Parameters only: the rope inverse frequencies stay fp32 (as in HF).
        for p in model.parameters():
            p.data = p.data.to(device=device, dtype=dtype)
        model.to(device)
        geom = world_geometry(args, dcp)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), geom.num_blocks, dtype=dtype,
                                             device=device, attention=model.attention_spec())
        _log(rank, f"[dcp={dcp}] tp={args.tp} pool {geom.num_blocks} pages x {args.block_size} tokens/rank "
                   f"({cache.sharded_bytes / 2**20:.2f} MiB KV/rank), compiling with {args.lowering}")
        compiled = cp_compile.compile_model(model, lowering=args.lowering)
        rows = []
        for context in args.context:
            for batch in args.batch:
                rows.append(_measure(rank, args, model, cfg, state.dcp_rank, cache, geom, compiled,
                                     context, batch, hf_config.vocab_size, device))
        return rows
    finally:
        cp_compile.destroy_parallel()
        torch._dynamo.reset()  # under torchrun the next world reuses this process


def _measure(rank: int, args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, dcp_rank: int,
             cache: cp_compile.KVCache, geom: WorldGeometry, compiled: Any, context: int, batch: int,
             vocab: int, device: torch.device) -> dict[str, Any]:
    """Fill, warm up and time one (context, batch) config; returns its JSON row."""
    t0 = time.perf_counter()
    alloc = cp_compile.BlockAllocator(geom.num_blocks, cfg.virtual_block_size)
    for rid in range(batch):  # reserve every page the decode steps will need up front
        alloc.ensure(rid, context + args.decode_steps)
    fill_context(cache, cfg, dcp_rank, alloc, context, batch, device, seed=1000 * dcp_rank + context)
    step_ms, recompiled = timed_decode(compiled, cache, alloc, context, batch, args, geom, vocab, device)
    graphs = len(compiled.backend.pass_managers)
    row = _config_row(args, model, cfg, context, batch, step_ms, geom.num_blocks - alloc.num_free, cache,
                      graphs, recompiled)
    _log(rank, f"[dcp={cfg.dcp}] context={context:>6} batch={batch:>3}: TPOT {row['tpot_ms']:8.2f} ms "
               f"(steps {', '.join(f'{t:.1f}' for t in step_ms)}), KV/rank "
               f"{row['kv_cache_bytes_per_rank'] / 2**20:.2f} MiB, graphs {graphs}"
               f"{' RECOMPILED IN TIMED STEPS' if recompiled else ''} [{time.perf_counter() - t0:.1f} s]")
    return row


def _spawned_rank(rank: int, world: int, args: BenchArgs, dcp: int, hf_config: Any,
                  state_dict: dict[str, torch.Tensor], nccl_store: str | None) -> list[dict[str, Any]]:
    """Entry point of a rank spawned by `run_on_ranks` (gloo already initialised)."""
    device = torch.device("cpu")
    if nccl_store is not None:
        # run_on_ranks sets up gloo; CUDA collectives need NCCL, so re-initialise the world.
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.destroy_process_group()
        dist.init_process_group("nccl", init_method=f"file://{nccl_store}", rank=rank, world_size=world)
    return run_world(rank, world, args, dcp, hf_config, state_dict, device)


# --------------------------------------------------------------------------- drivers


def _state_dict(hf: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in hf.state_dict().items()}


def run_spawned(args: BenchArgs) -> list[dict[str, Any]]:
    """One spawned world of `tp` ranks per DCP size; rank 0's rows (already max over ranks)."""
    hf = build_hf_model(args.model, args.tp)
    sd = _state_dict(hf)
    rows: list[dict[str, Any]] = []
    for dcp in args.dcp:
        print(f"== world tp={args.tp} dcp={dcp}: spawning {args.tp} ranks", flush=True)
        with tempfile.TemporaryDirectory(prefix="bench_nccl_") as tmp:
            store = os.path.join(tmp, "store") if torch.cuda.is_available() else None
            per_rank = run_on_ranks(_spawned_rank, args.tp, args, dcp, hf.config, sd, store, timeout=3600)
        rows.extend(per_rank[0])
    return rows


def run_torchrun(args: BenchArgs) -> list[dict[str, Any]]:
    """Every torchrun process runs each DCP world in turn; returns rows on every rank."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() \
        else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != args.tp:
        raise SystemExit(f"torchrun launched {world} processes but --tp {args.tp}: use --nproc-per-node={args.tp}")
    hf = build_hf_model(args.model, args.tp)  # seeded: identical weights on every rank
    sd = _state_dict(hf)
    rows: list[dict[str, Any]] = []
    for dcp in args.dcp:
        _log(rank, f"== world tp={args.tp} dcp={dcp} (torchrun)")
        rows.extend(run_world(rank, world, args, dcp, hf.config, sd, device))
    return rows


# --------------------------------------------------------------------------- outputs


def write_json(rows: list[dict[str, Any]], out: Path) -> Path:
    path = out / "bench_decode.json"
    path.write_text(json.dumps(rows, indent=1))
    return path


def plot(rows: list[dict[str, Any]], args: BenchArgs, out: Path) -> Path:
    """TPOT vs context (one line per (dcp, batch)) and KV bytes per rank vs context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_t, ax_kv) = plt.subplots(1, 2, figsize=(13, 5))
    styles = ["-", "--", ":", "-."]
    for i, dcp in enumerate(args.dcp):
        for j, batch in enumerate(args.batch):
            pts = sorted((r["context_len"], r) for r in rows if r["dcp"] == dcp and r["batch"] == batch)
            if not pts:
                continue
            ctx = [c for c, _ in pts]
            color = f"C{i}"
            ls = styles[j % len(styles)]
            label = f"dcp={dcp}, batch={batch}"
            ax_t.plot(ctx, [r["tpot_ms"] for _, r in pts], ls, marker="o", color=color, label=label)
            ax_kv.plot(ctx, [r["kv_cache_bytes_per_rank"] / 2**20 for _, r in pts], ls, marker="o", color=color,
                       label=label)
    title = (f"{args.model}, tp={args.tp}, {args.lowering}, {args.dtype}, merge={args.merge}, "
             f"block={args.block_size}, interleave={args.interleave}")
    for ax in (ax_t, ax_kv):
        ax.set_xscale("log", base=2)
        # Plain tick labels at the measured context lengths, not powers of two.
        ax.set_xticks(list(args.context), [str(c) for c in args.context])
        ax.minorticks_off()
        ax.set_xlabel("context length (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_ylabel("TPOT (ms, median decode step, max over ranks)")
    ax_t.set_title("Decode time per output token")
    ax_kv.set_yscale("log")
    ax_kv.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax_kv.set_ylabel("KV cache per rank (MiB)")
    ax_kv.set_title("KV cache bytes per rank (pages used)")
    fig.suptitle(f"DCP vs TP baseline: {title}")
    fig.tight_layout()
    path = out / "bench_decode.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def format_table(rows: list[dict[str, Any]], args: BenchArgs) -> str:
    """One line per (context, batch, dcp=N > 1) against the dcp = 1 baseline."""
    by = {(r["dcp"], r["context_len"], r["batch"]): r for r in rows}
    head = (f"{'context':>8} {'batch':>5} {'N':>3} {'TPOT dcp=1':>11} {'TPOT dcp=N':>11} {'N/1':>6} "
            f"{'KV/rank dcp=1':>14} {'KV/rank dcp=N':>14} {'KV N/1':>7} {'DCP comm B/step':>16} "
            f"{'TP AR B/step':>13}")
    lines = [head, "-" * len(head)]
    for context in args.context:
        for batch in args.batch:
            base = by.get((1, context, batch))
            for n in (d for d in args.dcp if d > 1):
                r = by.get((n, context, batch))
                if base is None or r is None:
                    continue
                lines.append(
                    f"{context:>8} {batch:>5} {n:>3} {base['tpot_ms']:>9.2f}ms {r['tpot_ms']:>9.2f}ms "
                    f"{r['tpot_ms'] / base['tpot_ms']:>6.2f} {_mib(base['kv_cache_bytes_per_rank']):>14} "
                    f"{_mib(r['kv_cache_bytes_per_rank']):>14} "
                    f"{r['kv_cache_bytes_per_rank'] / base['kv_cache_bytes_per_rank']:>7.3f} "
                    f"{r['comm_bytes_per_step']:>16,} {r['tp_allreduce_bytes_per_step']:>13,}")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.3f} MiB"


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Run the sweep, write JSON + PNG (rank 0), print the table; returns the rows."""
    args = parse_args(argv)
    torchrun = "RANK" in os.environ
    t0 = time.perf_counter()
    if torchrun:
        rows = run_torchrun(args)
        rank = dist.get_rank()
        dist.destroy_process_group()
        if rank != 0:
            return rows
    else:
        rows = run_spawned(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = write_json(rows, out)
    png_path = plot(rows, args, out)
    print(f"\n{args.model} tp={args.tp} dcp={list(args.dcp)} lowering={args.lowering} dtype={args.dtype} "
          f"merge={args.merge} block={args.block_size} interleave={args.interleave} "
          f"steps={args.steps} warmup={args.warmup} ({time.perf_counter() - t0:.0f} s)")
    print(format_table(rows, args))
    if any(r["recompiled_in_timed_steps"] for r in rows):
        print("WARNING: a graph was compiled during timed steps; raise --warmup", flush=True)
    print(f"\nwrote {json_path} and {png_path}", flush=True)
    return rows


if __name__ == "__main__":
    main()
