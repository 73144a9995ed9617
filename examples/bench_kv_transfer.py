"""KV-transfer throughput (PD disaggregation over NIXL, loopback): a standalone measurement.

Two worlds as in `examples/pd_disagg.py` (P and D, separate process groups), caches at
a real per-rank shape filled with random values (no model runs: the prefill
benchmark cannot host a 16k-token prompt on this machine's CPU ranks in reasonable
time, so the transfer is timed on its own). P exports `--requests` requests of
`--tokens` tokens; every D rank imports each one (its reads, layer by layer, from
the P ranks that hold its tokens) and reports bytes and seconds. Prints per-rank and
aggregate GB/s, bytes against the formula, and writes JSON rows to `--out`.

    python -m examples.bench_kv_transfer --tokens 16384 --layers 8 --shape qwen3-235b-a22b-tp8 --compare
    python -m examples.bench_kv_transfer --tokens 16384 --layers 8 --shape deepseek-r1-tp8 --p-dcp 2 --d-dcp 2

`--prefill` (the transfer's share of TTFT): P runs the example model at the shape's
per-rank attention and MLP (`examples/bench/shapes.py`, `--layers` of them) on a random
prompt of `--tokens` per request, batch 1, and exports the KV that prefill wrote; D
reads it as above. One request at a time (P prefills the next after D's verdict, so
the two never share this machine's cores): per request the prefill's seconds (max
over P ranks) beside the transfer's (slowest D rank), and the share
transfer / (prefill + transfer). Both scale with the layer count, so the share does
not depend on `--layers`.

    python -m examples.bench_kv_transfer --prefill --tokens 16384 --layers 1 --dtype float32 \
        --p-dcp 1 --d-dcp 2 --d-interleave 128
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch

import cp_compile
from cp_compile.serving.kv_transfer import KVConsumer, KVLayout, KVProducer, expected_bytes
from cp_compile.serving.kv_transfer.layout import KVGeometry
from cp_compile.serving.kv_transfer.plan import plan_rank
from cp_compile.serving.kv_transfer.reads import layer_reads
from cp_compile.testing.two_worlds import run_two_worlds

SHAPES = {  # per-rank attention of the deployments in examples/bench/shapes.py
    "qwen3-235b-a22b-tp8": dict(kind="gqa", head_dim=128, num_heads=16, num_kv_heads=1),
    "deepseek-r1-tp8": dict(kind="mla", latent_dim=512 + 64, num_heads=16),
}


def _specs(shape: str, layers: int):
    s = SHAPES[shape]
    if s["kind"] == "gqa":
        return (cp_compile.KVCacheSpec(layers, "gqa", head_dim=s["head_dim"], v_head_dim=s["head_dim"],
                                       num_kv_heads_per_rank=1),
                cp_compile.AttentionSpec("gqa", s["num_heads"], s["num_kv_heads"]))
    return cp_compile.KVCacheSpec(layers, "mla", latent_dim=s["latent_dim"]), cp_compile.AttentionSpec("mla", 16)


def _side(rank: int, cfg: cp_compile.CPConfig, a: argparse.Namespace):
    state = cp_compile.init_parallel(cfg, device="cpu")
    spec, attention = _specs(a.shape, a.layers)
    blocks = a.requests * -(-a.tokens // cfg.virtual_block_size)
    cache = cp_compile.allocate_kv_cache(cfg, spec, blocks, dtype=getattr(torch, a.dtype), attention=attention)
    return state, spec, attention, cache, cp_compile.BlockAllocator(blocks, cfg.virtual_block_size)


def _kv(role: str, port: int) -> dict:
    extra = {"transfer_timeout_s": 300.0, "remote_engine_id": "bench-p"} if role == "kv_consumer" else {}
    return {"kv_role": role, "engine_id": "bench-p" if role == "kv_producer" else "bench-d", "kv_port": port,
            "kv_connector_extra_config": extra}


def _prefill_model(state: Any, cfg: cp_compile.CPConfig, a: argparse.Namespace) -> Any:
    """The example model at `a.shape`'s per-rank shapes, `a.layers` layers (seeded weights)."""
    from dataclasses import replace

    from examples.bench.shapes import PRESETS

    preset = replace(PRESETS[a.shape], layers=a.layers)
    tp = cfg.tensor_parallel_size
    torch.manual_seed(1234 + state.layout.tp.rank)
    mcfg = preset.model_config(tp)
    if preset.kind == "qwen3":
        from examples.models.qwen3 import Qwen3Model

        return Qwen3Model(mcfg, tp, state.layout.tp.rank, state.tp_group).eval()
    from examples.models.deepseek_mla import DeepseekMLAModel

    return DeepseekMLAModel(mcfg, tp, state.layout.tp.rank, state.tp_group).eval()


class _FirstTokenZero:
    """Exports with first token 0: the preset's seeded weights differ per rank outside the
    TP shards, so the ranks' sampled tokens differ (the bench times, it does not decode)."""

    def __init__(self, producer: KVProducer) -> None:
        self.producer = producer

    def export(self, req_id: int, num_tokens: int, block_table: list[int], first_token: int) -> None:
        self.producer.export(req_id, num_tokens, block_table, 0)


def prefill_timed_world(rank: int, world: int, port: int, cfg: cp_compile.CPConfig, a: argparse.Namespace) -> dict:
    """`--prefill`: each request prefilled by the model (timed), exported, consumed, then the next."""
    from examples.serving import layer_caches, prefill_and_export

    state, spec, attention, cache, alloc = _side(rank, cfg, a)
    model = _prefill_model(state, cfg, a)
    if (model.kv_cache_spec().num_layers, model.attention_spec()) != (spec.num_layers, attention):
        raise SystemExit(f"the model's cache ({model.kv_cache_spec()}, {model.attention_spec()}) is not the "
                         f"bench's ({spec}, {attention}) at tp {cfg.tensor_parallel_size}")
    forward = model
    if cfg.context_parallel_size > 1:
        forward = cp_compile.compile_model(model, lowering="eager")
    producer = KVProducer(_kv("kv_producer", port), cfg, cache, spec, attention, rank)
    g = torch.Generator().manual_seed(0)  # the same prompts on every P rank
    seconds, verdicts = [], []
    for r in range(a.requests):
        prompt = torch.randint(0, 1024, (a.tokens,), generator=g).tolist()
        torch.distributed.barrier()
        t0 = time.perf_counter()
        prefill_and_export(forward, layer_caches(cache), alloc, {r: prompt}, _FirstTokenZero(producer),
                           max_blocks_per_req=-(-a.tokens // cfg.virtual_block_size))
        seconds.append(time.perf_counter() - t0)
        verdicts.append(producer.wait_consumed(r))
    return dict(verdicts=verdicts, prefill_s=seconds)


def prefill_world(rank: int, world: int, port: int, cfg: cp_compile.CPConfig, a: argparse.Namespace) -> dict:
    if a.prefill:
        return prefill_timed_world(rank, world, port, cfg, a)
    state, spec, attention, cache, alloc = _side(rank, cfg, a)
    g = torch.Generator().manual_seed(rank)
    for layer in cache.layers:
        for t in layer:
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))  # stands for a prefill's KV
    producer = KVProducer(_kv("kv_producer", port), cfg, cache, spec, attention, rank)
    for r in range(a.requests):
        producer.export(r, a.tokens, alloc.ensure(r, a.tokens), first_token=0)
    verdicts = [producer.wait_consumed(r) for r in range(a.requests)]
    return dict(verdicts=verdicts)


def decode_world(rank: int, world: int, port: int, cfg: cp_compile.CPConfig, a: argparse.Namespace) -> dict:
    state, spec, attention, cache, alloc = _side(rank, cfg, a)
    consumer = KVConsumer(_kv("kv_consumer", port), cfg, cache, spec, attention, rank, alloc,
                          coalesce=not a.no_coalesce)
    rows = []
    for r in range(a.requests):
        imp = consumer.import_request(r)
        rows.append(dict(bytes=imp.bytes_moved, seconds=imp.seconds, src_ranks=list(imp.src_ranks),
                         descriptors=imp.descriptors, uncoalesced=_uncoalesced(consumer, r)))
    return dict(rank=rank, rows=rows)


def _uncoalesced(consumer: KVConsumer, req_id: int) -> int:
    """Descriptors the same request takes with one per plan run (the reads before coalescing)."""
    infos = consumer.producer()
    ready = consumer.exchange.fetch_ready(req_id, len(infos), 10.0, 10.0)
    plan = plan_rank(infos[0].layout, consumer.layout, consumer.geometry, ready.num_tokens, ready.block_table,
                     consumer.allocator.blocks(req_id), consumer.rank)
    remote = {s: infos[s].regions for s in plan.src_ranks()}
    return sum(layer_reads(plan, consumer.regions, remote, layer, coalesce=False).num_descriptors
               for layer in range(consumer.geometry.num_layers))


def run_one(a: argparse.Namespace, p_interleave: int) -> dict:
    """One pair of worlds: `a.requests` requests; per-request aggregate GB/s (bytes into
    every D rank / the slowest D rank's seconds) and descriptors per D rank."""
    p_cfg = cp_compile.CPConfig(tensor_parallel_size=a.p_tp, decode_context_parallel_size=a.p_dcp,
                                cp_kv_cache_interleave_size=p_interleave, block_size=a.p_block_size)
    d_cfg = cp_compile.CPConfig(tensor_parallel_size=a.d_tp, decode_context_parallel_size=a.d_dcp,
                                cp_kv_cache_interleave_size=a.d_interleave, block_size=a.d_block_size)
    p, d = run_two_worlds(prefill_world, a.p_tp, (p_cfg, a), decode_world, a.d_tp, (d_cfg, a), timeout=1200)
    failed = [f"{who} instance failed: {out}" for out, who in ((p, "prefill"), (d, "decode"))
              if isinstance(out, BaseException)]
    if failed:
        raise SystemExit("\n".join(failed))
    spec, attention = _specs(a.shape, a.layers)
    geo = KVGeometry.of(spec, attention, getattr(torch, a.dtype))
    formula = expected_bytes(geo, KVLayout.from_config(d_cfg), a.tokens)
    name = (f"P(tp{a.p_tp},dcp{a.p_dcp},I{p_interleave},bs{a.p_block_size}) -> D(tp{a.d_tp},dcp{a.d_dcp},"
            f"I{a.d_interleave},bs{a.d_block_size})")
    print(f"{a.shape}, {a.tokens} tokens, {a.layers} layers, {a.dtype}: {name}; formula {formula} B per request")
    rows = []
    for r in range(a.requests):
        per = [o["rows"][r] for o in d]
        total, slowest = sum(x["bytes"] for x in per), max(x["seconds"] for x in per)
        prefill_s = max(o["prefill_s"][r] for o in p) if a.prefill else None
        rows.append(dict(request=r, bytes=total, formula=formula, seconds=slowest, gb_per_s=total / slowest / 1e9,
                         prefill_s=prefill_s, share=None if prefill_s is None else slowest / (prefill_s + slowest),
                         per_rank=[dict(rank=o["rank"], **o["rows"][r],
                                        gb_per_s=o["rows"][r]["bytes"] / o["rows"][r]["seconds"] / 1e9) for o in d]))
        ranks = ", ".join(f"D{x['rank']} {x['bytes'] / 1e6:.1f} MB {x['seconds'] * 1e3:.1f} ms "
                          f"({x['gb_per_s']:.2f} GB/s, {x['descriptors']} descriptors, uncoalesced "
                          f"{x['uncoalesced']}) from P{x['src_ranks']}" for x in rows[-1]["per_rank"])
        print(f"  request {r}: {total / 1e6:.1f} MB (== formula: {total == formula}) in {slowest * 1e3:.1f} ms "
              f"= {rows[-1]['gb_per_s']:.3f} GB/s aggregate; {ranks}"
              + (f"; prefill on P {prefill_s:.2f} s, transfer share of TTFT {rows[-1]['share']:.4f}"
                 if a.prefill else ""))
    return dict(name=name, p_interleave=p_interleave, rows=rows, formula=formula)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-235b-a22b-tp8")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    for side in ("p", "d"):
        ap.add_argument(f"--{side}-tp", type=int, default=2)
        ap.add_argument(f"--{side}-dcp", type=int, default=2 if side == "p" else 1)
        ap.add_argument(f"--{side}-interleave", type=int, default=1)
        ap.add_argument(f"--{side}-block-size", type=int, default=128)
    ap.add_argument("--compare", action="store_true",
                    help="block interleave (P interleave = block size) and token interleave (P interleave 1), "
                         "one after the other, side by side")
    ap.add_argument("--no-coalesce", action="store_true", help="one descriptor per plan run (before coalescing)")
    ap.add_argument("--prefill", action="store_true", help="P prefills each request with the model (timed): the "
                    "transfer's share of TTFT (see the module doc)")
    ap.add_argument("--out", default="results/bench_kv_transfer")
    a = ap.parse_args(argv)
    interleaves = [a.p_block_size, 1] if a.compare else [a.p_interleave]
    runs = [run_one(a, i) for i in interleaves]
    print(f"\n| P interleave | layout | descriptors per D rank per request (uncoalesced -> posted) | "
          f"GB/s aggregate median [min, max] over {a.requests} requests | bytes == formula |")
    print("|---|---|---|---|---|")
    for run in runs:
        g = sorted(r["gb_per_s"] for r in run["rows"])
        desc = sorted({(x["uncoalesced"], x["descriptors"]) for r in run["rows"] for x in r["per_rank"]})
        print(f"| {run['p_interleave']} | {run['name']} | {', '.join(f'{u} -> {c}' for u, c in desc)} | "
              f"{statistics.median(g):.3f} [{g[0]:.3f}, {g[-1]:.3f}] | "
              f"{all(r['bytes'] == run['formula'] for r in run['rows'])} |")
    if a.prefill:
        print(f"\n| layout | tokens | layers | prefill on P s | transfer to D s | transfer share of TTFT "
              f"(median [min, max] over {a.requests} requests) |")
        print("|---|---|---|---|---|---|")
        for run in runs:
            cols = [sorted(r[k] for r in run["rows"]) for k in ("prefill_s", "seconds", "share")]
            fmt = ["{:.2f}", "{:.3f}", "{:.4f}"]
            print(f"| {run['name']} | {a.tokens} | {a.layers} | " + " | ".join(
                f"{f.format(statistics.median(c))} [{f.format(c[0])}, {f.format(c[-1])}]" for f, c in zip(fmt, cols))
                + " |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_kv_transfer.json"), "w") as f:
        json.dump(dict(args=vars(a), runs=runs, time=time.time()), f, indent=1)
    return 0 if all(r["bytes"] == run["formula"] for run in runs for r in run["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
