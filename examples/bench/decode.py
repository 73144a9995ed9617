"""The decode sweep of one world, DCP and its dcp = 1 baseline side by side, step by step.

A world is (dcp, merge) on `tp` ranks. When dcp > 1 it also holds the TP baseline:
the same model (same weights, same process) compiled with the plain lowering over
a full dcp = 1 KV pool (at dcp = 1 the cp_ascend pass has nothing to rewrite, so
that is what cp_ascend runs). Baseline and DCP steps alternate (AB, BA, AB, ...),
so a slow spell of a shared machine hits both alike and their ratio is fair.

- each KV pool is allocated once per world, big enough for the largest config, so
  the cache tensors (graph inputs) keep their shapes across configs; the block
  table width is fixed per world for the same reason;
- the context is filled directly (`cache.fill_context`), so decode attends over
  `context` cached tokens without a long prefill on CPU;
- `warmup` decode steps (which absorb any recompile for a new batch size), then
  `steps` timed decode steps of `batch` requests, one new token each, positions
  advancing; each step is bracketed by barriers, its time is the max over ranks;
- then `profile_steps` more steps under the torch profiler on every rank, for the
  per-step breakdown (`profile.py`); they are not in the TPOT (profiling costs time);
- with `compile_probe`, after the sweep: a fresh compile of the same model with the
  plain lowering, with cp_ascend, and with the plain lowering again (`compile_probe`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

import cp_compile
from cp_compile.compiler.decorator import CompiledForward
from examples.bench.args import BenchArgs
from examples.bench.cache import WorldGeometry, fill_context, reserve, world_geometry
from examples.bench.launch import World, log
from examples.bench.profile import CATEGORIES, STEP, breakdown, median_breakdown, profiling
from examples.bench.rows import add_paired_ratios, decode_row
from examples.bench.shapes import ModelSource, model_source
from examples.bench.timing import max_over_ranks, timed_step
from examples.serving import layer_caches

_DYNAMIC = ("input_ids", "positions", "meta")


def decode_source(args: BenchArgs) -> ModelSource:
    """What the ranks build the model from (tiny HF weights, or a shape preset)."""
    return model_source(args.shape, args.model, args.tp)


def _decode_inputs(context: int, step: int, batch: int, alloc: cp_compile.BlockAllocator, width: int, vocab: int,
                   g: torch.Generator, device: torch.device) -> tuple[torch.Tensor, Any]:
    meta = cp_compile.build_attention_metadata([(context + step, 1)] * batch, alloc, max_blocks_per_req=width,
                                               device=device)
    return torch.randint(0, vocab, (batch,), generator=g).to(device), meta


@dataclass
class Side:
    """One of the models a world times: the DCP model or its dcp = 1 baseline."""

    cfg: cp_compile.CPConfig
    merge: str
    dcp_rank: int
    cache: cp_compile.KVCache
    geom: WorldGeometry
    compiled: Any
    graphs: Callable[[], int]  # graphs compiled so far


class _CountingBackend:
    """The plain lowering, counting the graphs it compiles."""

    def __init__(self, lowering: str) -> None:
        self.inner = torch._dynamo.lookup_backend(lowering)
        self.graphs = 0

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        self.graphs += 1
        return self.inner(gm, example_inputs)


class PlainCompiled:
    """`forward(input_ids, positions, kv_caches, meta)` compiled with a plain backend, with the
    same dynamic token dims as `cp_compile.compile_model` (no cp pass, no input validation)."""

    def __init__(self, forward: Callable[..., Any], backend: Any) -> None:
        self.backend = backend
        self.compiled = torch.compile(forward, backend=backend, fullgraph=True)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Any, meta: Any) -> Any:
        for t in (input_ids, positions):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for f in dataclasses.fields(meta):
            t = getattr(meta, f.name)
            if isinstance(t, torch.Tensor):
                for d in range(t.dim()):
                    torch._dynamo.maybe_mark_dynamic(t, d)
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return self.compiled(input_ids, positions, kv_caches, meta)


StepInputs = Callable[[int], list[tuple[torch.Tensor, Any]]]  # step -> (input_ids, meta) per side


def timed_decode(sides: list[Side], allocs: list[cp_compile.BlockAllocator], context: int, batch: int,
                 args: BenchArgs, vocab: int, device: torch.device
                 ) -> list[tuple[list[float], int, list[dict[str, float]]]]:
    """`alternate_steps` over decode steps: one new token per request, positions advancing."""
    g = torch.Generator().manual_seed(context * 131 + batch)

    def inputs(step: int) -> list[tuple[torch.Tensor, Any]]:
        ids = torch.randint(0, vocab, (batch,), generator=g).to(device)
        return [(ids, cp_compile.build_attention_metadata([(context + step, 1)] * batch, alloc,
                                                          max_blocks_per_req=side.geom.max_blocks_per_req,
                                                          device=device)) for side, alloc in zip(sides, allocs)]

    return alternate_steps(sides, inputs, args, device)


def alternate_steps(sides: list[Side], step_inputs: StepInputs, args: BenchArgs, device: torch.device
                    ) -> list[tuple[list[float], int, list[dict[str, float]]]]:
    """Warm-up, timed, then profiled steps, the sides alternating step by step (AB, BA, ...).

    `step_inputs(step)` gives each side's (input_ids, meta); it runs outside the timed
    region (building metadata is the runtime's job, not the model's). Per side: each
    timed step's time in ms (max over ranks), the graphs compiled after the warm-up
    (max over ranks; their compile time would be in the step time), and each rank's
    median breakdown of the profiled steps (empty without profiling).
    """
    times: list[list[float]] = [[] for _ in sides]
    graphs_after_warmup = [s.graphs() for s in sides]
    timed_end = args.warmup + args.steps

    def run_step(step: int, label: str) -> list[float]:
        inputs = step_inputs(step)
        out = [0.0] * len(sides)
        for i in (range(len(sides)) if step % 2 == 0 else reversed(range(len(sides)))):
            side = sides[i]
            ids, meta = inputs[i]

            def step_fn() -> None:
                with torch.no_grad(), torch.profiler.record_function(f"{label}:{i}"):
                    side.compiled(ids, meta.positions, layer_caches(side.cache), meta)

            out[i] = timed_step(step_fn, device)
        return out

    for step in range(timed_end):
        if step == args.warmup:
            graphs_after_warmup = [s.graphs() for s in sides]
        elapsed = run_step(step, "bench::timed")
        if step >= args.warmup:
            for i, t in enumerate(elapsed):
                times[i].append(t)
    # The profiler runs only around the extra steps: its overhead stays out of the TPOT.
    with profiling(args.profile_steps > 0) as prof:
        for step in range(timed_end, args.decode_steps):
            run_step(step, STEP)
    results = []
    for i, side in enumerate(sides):
        recompiles = side.graphs() - graphs_after_warmup[i]
        steps = breakdown(prof, f"{STEP}:{i}") if prof is not None else []
        per_rank: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, median_breakdown(steps))
        results.append((max_over_ranks(times[i], device), int(max_over_ranks([float(recompiles)], device)[0]),
                        per_rank))
    return results


class _TimedPasses:
    """A pass manager that adds the seconds its passes take to `sink["pass_s"]`."""

    def __init__(self, pm: Any, sink: dict[str, float]) -> None:
        self._pm, self._sink = pm, sink

    def __call__(self, gm: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._pm(gm)
        finally:
            self._sink["pass_s"] += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pm, name)


def _timed_backends(model: torch.nn.Module, lowering: str) -> tuple[Any, Any, dict[str, float]]:
    """(plain backend, cp_ascend backend, seconds each spent in its backend call / in the DCP passes).

    The cp_ascend backend is the one `compile_model` builds for this model (its config,
    attention spec and roles), re-classed to time its calls.
    """
    sink = {"backend_s_plain": 0.0, "backend_s_cp_ascend": 0.0, "pass_s": 0.0}
    inner = torch._dynamo.lookup_backend(lowering)

    def plain(gm: Any, example_inputs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(gm, example_inputs)
        finally:
            sink["backend_s_plain"] += time.perf_counter() - t0

    ref = cp_compile.compile_model(model, lowering=lowering).backend

    class TimedCpAscend(type(ref)):  # type: ignore[misc]
        def make_pass_manager(self) -> Any:
            return _TimedPasses(super().make_pass_manager(), sink)

        def __call__(self, gm: Any, example_inputs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return super().__call__(gm, example_inputs)
            finally:
                sink["backend_s_cp_ascend"] += time.perf_counter() - t0

    timed = TimedCpAscend.__new__(TimedCpAscend)
    timed.__dict__.update(ref.__dict__)
    timed.pass_managers = []
    return plain, timed, sink


def compile_probe(model: torch.nn.Module, dcp_side: Side, base: Side, args: BenchArgs, vocab: int,
                  device: torch.device) -> dict[str, Any]:
    """Seconds to compile (and run once, batch 2, 16 tokens of context) a fresh copy of the model's
    forward: plain lowering, cp_ascend, cp_ascend, plain (ABBA), max over ranks, the faster run
    of each; the ratio is of those. Also the mean seconds spent inside each backend (cp_ascend:
    DCP pass + lowering) and in the DCP pass alone, so that the rest (Dynamo tracing, guards,
    the one step) is the difference.

    Dynamo is reset before each, and Inductor's FX-graph and AOT caches are off, so each
    compile traces, runs its passes and lowers the whole graph; the kernel caches on disk
    stay warm (the sweep compiled the same kernels), as on any run but the very first.
    The plain run uses the baseline's dcp = 1 cache (its attention is the single-device op).
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    plain_backend, cp_backend, sink = _timed_backends(model, args.lowering)

    def once(plain: bool) -> float:
        torch._dynamo.reset()
        fn = PlainCompiled(model.forward, plain_backend) if plain else \
            CompiledForward(model, model.forward, _DYNAMIC, cp_backend)
        side = base if plain else dcp_side
        alloc = reserve(side.geom, side.cfg, 2, 17)
        ids, meta = _decode_inputs(16, 0, 2, alloc, side.geom.max_blocks_per_req, vocab,
                                   torch.Generator().manual_seed(0), device)

        def step_fn() -> None:
            with torch.no_grad():
                fn(ids, meta.positions, layer_caches(side.cache), meta)

        return timed_step(step_fn, device) / 1e3

    # ABBA, and the fastest of each pair: load on a shared machine only ever adds time,
    # so the minimum is the estimate least moved by a slow spell.
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        secs = [once(True), once(False), once(False), once(True)]
    torch._dynamo.reset()
    secs = max_over_ranks(secs + [sink["backend_s_plain"] / 2, sink["backend_s_cp_ascend"] / 2,
                                  sink["pass_s"] / 2], device)
    plain, cp = min(secs[0], secs[3]), min(secs[1], secs[2])
    return dict(compile_s_cp_ascend=cp, compile_s_plain=plain, compile_s_plain_runs=[secs[0], secs[3]],
                compile_s_cp_ascend_runs=[secs[1], secs[2]], compile_ratio=cp / plain, backend_s_plain=secs[4],
                backend_s_cp_ascend=secs[5], dcp_pass_s=secs[6])


def _side(args: BenchArgs, model: torch.nn.Module, cfg: cp_compile.CPConfig, merge: str, dcp_rank: int,
          plain: bool, device: torch.device, tokens_per_req: int) -> Side:
    geom = world_geometry(args.block_size, cfg.decode_context_parallel_size, tokens_per_req, max(args.batch), 0)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), geom.num_blocks, dtype=args.torch_dtype,
                                         device=device, attention=model.attention_spec())
    if plain:
        backend = _CountingBackend(args.lowering)
        compiled = PlainCompiled(model.forward, backend)
        return Side(cfg, merge, 0, cache, geom, compiled, lambda: backend.graphs)
    compiled = cp_compile.compile_model(model, lowering=args.lowering)
    return Side(cfg, merge, dcp_rank, cache, geom, compiled, lambda: len(compiled.backend.pass_managers))


def merge_decision(side: Side) -> dict | None:
    """The DCP pass's merge decision in the side's latest compiled graph (merge, reason,
    predicted seconds per layer of each merge; passes/merge_choice.py), None at dcp = 1."""
    for pm in reversed(getattr(getattr(side.compiled, "backend", None), "pass_managers", None) or []):
        for rec in pm.history:
            if getattr(rec, "decision", None):
                return rec.decision
    return None


def init_world(args: BenchArgs, world: World, device: torch.device) -> Any:
    """`init_parallel` for a (dcp, merge) world of `args.tp` ranks; its parallel state."""
    dcp, merge = world
    cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, decode_context_parallel_size=dcp,
                              cp_kv_cache_interleave_size=args.interleave, block_size=args.block_size,
                              dcp_merge=merge if dcp > 1 else "ag_rs")
    return cp_compile.init_parallel(cfg, device=device)


def build_sides(rank: int, world_size: int, args: BenchArgs, world: World, source: ModelSource, state: Any,
                device: torch.device, tokens_per_req: int) -> tuple[torch.nn.Module, list[Side]]:
    """The model on this rank, and its sides: the dcp = 1 baseline first (when dcp > 1), then the
    model at the world's dcp; each KV pool holds `max(args.batch)` requests of `tokens_per_req`."""
    dcp, merge = world
    t0 = time.perf_counter()
    model = source.build(world_size, state.layout.tp.rank, state.tp_group)
    # Parameters only: the rope inverse frequencies stay fp32 (as in HF).
    for p in model.parameters():
        p.data = p.data.to(device=device, dtype=args.torch_dtype)
    model.to(device)
    sides = []
    if dcp > 1:  # the baseline first: side 0
        base_cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, block_size=args.block_size)
        sides.append(_side(args, model, base_cfg, "none", 0, True, device, tokens_per_req))
    sides.append(_side(args, model, state.cfg, merge, state.layout.dcp.rank, False, device, tokens_per_req))
    log(rank, f"[dcp={dcp} {merge}] {args.shape} tp={args.tp}: model built in {time.perf_counter() - t0:.1f} s; "
              + "; ".join(f"dcp={s.cfg.decode_context_parallel_size} pool {s.geom.num_blocks} pages x {args.block_size} tokens/rank "
                          f"({s.cache.sharded_bytes / 2**20:.2f} MiB KV/rank)" for s in sides)
              + f"; compiling with {args.lowering}")
    return model, sides


def run_world(rank: int, world_size: int, args: BenchArgs, world: World, source: ModelSource,
              device: torch.device) -> list[dict[str, Any]]:
    """One (dcp, merge) on an initialised world, with its baseline when dcp > 1: compile once,
    sweep (context, batch)."""
    dcp, merge = world
    state = init_world(args, world, device)
    try:
        model, sides = build_sides(rank, world_size, args, world, source, state, device,
                                   tokens_per_req=max(args.context) + args.decode_steps)
        rows = []
        for context in args.context:
            for batch in args.batch:
                rows += measure(rank, args, model, sides, world, context, batch, source, device)
        if args.compile_probe and dcp > 1:
            t0 = time.perf_counter()
            probe = compile_probe(model, sides[-1], sides[0], args, source.vocab_size, device)
            log(rank, f"[dcp={dcp} {merge}] compile probe: cp_ascend {probe['compile_s_cp_ascend']:.1f} s "
                      f"(backend {probe['backend_s_cp_ascend']:.1f} s, DCP pass {probe['dcp_pass_s']:.2f} s), "
                      f"{args.lowering} {probe['compile_s_plain']:.1f} s (backend {probe['backend_s_plain']:.1f} s), "
                      f"ratio {probe['compile_ratio']:.2f} [{time.perf_counter() - t0:.0f} s]")
            for r in rows:
                if r["dcp"] > 1:
                    r.update(probe)
        return rows
    finally:
        cp_compile.destroy_parallel()
        torch._dynamo.reset()  # under torchrun the next world reuses this process


def measure(rank: int, args: BenchArgs, model: torch.nn.Module, sides: list[Side], world: World, context: int,
            batch: int, source: ModelSource, device: torch.device) -> list[dict[str, Any]]:
    """Fill, warm up, time and profile one (context, batch) config on every side; their JSON rows."""
    t0 = time.perf_counter()
    allocs = []
    for side in sides:
        alloc = reserve(side.geom, side.cfg, batch, context + args.decode_steps)
        fill_context(side.cache, side.cfg, side.dcp_rank, alloc, context, batch, device,
                     seed=1000 * side.dcp_rank + context)
        allocs.append(alloc)
    results = timed_decode(sides, allocs, context, batch, args, source.vocab_size, device)
    rows = []
    for side, alloc, (step_ms, recompiles, per_rank) in zip(sides, allocs, results):
        graphs = side.graphs()
        decision = merge_decision(side)
        cfg = side.cfg
        if cfg.dcp_merge == "auto" and decision is not None:  # the bytes of the merge the pass chose
            cfg = dataclasses.replace(cfg, dcp_merge=decision["merge"])
        row = decode_row(args, model, cfg, side.merge, context, batch, step_ms,
                         side.geom.num_blocks - alloc.num_free, side.cache, graphs, recompiles, per_rank,
                         source.real_layers, world)
        row["merge_decision"] = decision
        bd = row["breakdown_ms"]
        parts = ", ".join(f"{k} {bd[k]:.1f}" for k in CATEGORIES) if bd else "no profile"
        if bd and per_rank and per_rank[0].get("other_ops"):
            parts += "; other on rank 0: " + ", ".join(f"{n} {ms:.1f}" for n, ms in list(per_rank[0]["other_ops"].items())[:5])
        log(rank, f"[dcp={side.cfg.decode_context_parallel_size} {side.merge}] context={context:>6} batch={batch:>3}: TPOT "
                  f"{row['tpot_ms']:8.2f} ms (steps {', '.join(f'{t:.1f}' for t in step_ms)}), KV/rank "
                  f"{row['kv_cache_bytes_per_rank'] / 2**20:.2f} MiB, graphs {graphs}"
                  f"{f' RECOMPILED {recompiles} AFTER WARM-UP' if recompiles else ''}; profiled ms: {parts}")
        rows.append(row)
    add_paired_ratios(rows, "tpot_ratio_paired")
    log(rank, f"  [{time.perf_counter() - t0:.1f} s]")
    return rows
