"""MLAPO benchmark: the `mla_preprocess` pass off vs on, side by side in one run.

    python -m examples.bench_mla_preprocess [--tokens 256] [--decode-batch 8] [--steps 5] [--lowering inductor]

The DeepSeek-R1 per-rank shape at tp 8 (examples/bench/shapes.py `deepseek-r1-tp8`:
hidden 7168, 16 heads of nope 128 + rope 64, q_lora 1536, latent 512 + 64, MLP 2304),
2 layers, small vocab, fp32 on this machine's device. Both models hold the same
weights and compile with the same lowering; prefill (one request of `--tokens`) and
decode (`--decode-batch` requests of one token on a `--tokens` context) steps run
alternately off / on, and the table gives the median step time of each and the
graph's ops per layer before and after the pass (Dynamo FX nodes, as the pass
history counts them). Prints one JSON line too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

import torch

import cp_compile
from cp_compile.metadata import BlockAllocator, build_attention_metadata
from examples.bench.shapes import PRESETS
from examples.models.deepseek_mla import DeepseekMLAModel

LAYERS = 2


def _model(seed: int = 0) -> DeepseekMLAModel:
    cfg = dataclasses.replace(PRESETS["deepseek-r1-tp8"].model_config(1), num_layers=LAYERS)
    torch.manual_seed(seed)
    model = DeepseekMLAModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, p.shape[-1] ** -0.5)
    return model


def _steps(tokens: int, batch: int, block: int, num_blocks: int):
    prefill = build_attention_metadata([(0, tokens)], BlockAllocator(num_blocks, block))
    decode = build_attention_metadata([(tokens, 1)] * batch, BlockAllocator(num_blocks, block))
    return {"prefill": prefill, "decode": decode}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lowering", default="inductor")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    block = 16
    num_blocks = (args.tokens // block + 2) * args.decode_batch + 4
    base = _model()
    runs = {}
    for on in (False, True):
        model = _model()
        model.load_state_dict(base.state_dict())
        cfg = cp_compile.CPConfig(block_size=block, enable_mla_preprocess=on)
        cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), num_blocks)
        t0 = time.perf_counter()
        compiled = cp_compile.compile_model(model, lowering=args.lowering, config=cfg)
        runs[on] = dict(fn=compiled, cache=cache, compile_s=0.0, t0=t0)
    metas = _steps(args.tokens, args.decode_batch, block, num_blocks)
    times: dict[tuple[bool, str], list[float]] = {}
    cpu: dict[tuple[bool, str], list[float]] = {}
    logits: dict[tuple[bool, str], torch.Tensor] = {}
    for step in range(args.steps + 1):  # step 0 compiles (prefill and decode share the graph)
        for kind, meta in metas.items():
            ids = torch.arange(meta.num_tokens) % 1000
            for on in (False, True):
                r = runs[on]
                t, c = time.perf_counter(), time.process_time()
                logits[(on, kind)] = r["fn"](ids, meta.positions, r["cache"].layers, meta)
                dt, dc = time.perf_counter() - t, time.process_time() - c
                if step == 0:
                    r["compile_s"] += dt
                else:
                    times.setdefault((on, kind), []).append(dt)
                    # CPU seconds of this process (all threads): less sensitive than wall time
                    # to other jobs on a shared machine.
                    cpu.setdefault((on, kind), []).append(dc)
    hist = {}
    for on in (False, True):
        pm = runs[on]["fn"].backend.pass_managers[0]
        rec = {h.name: h for h in pm.history}
        total = sum(pm.history[0].before.values()) if pm.history else None
        if on:
            mla = rec["mla_preprocess"]
            hist = dict(rewrites=mla.rewrites, writes_folded=rec["mla_preprocess_cache_write"].rewrites,
                        ops_before=sum(mla.before.values()), ops_after=sum(rec["mla_preprocess_cache_write"].after
                                                                           .values()))
        runs[on]["graph_ops"] = total
    per_layer = (hist["ops_before"] - hist["ops_after"]) / LAYERS
    out = dict(shape="deepseek-r1-tp8", layers=LAYERS, tokens=args.tokens, decode_batch=args.decode_batch,
               lowering=args.lowering, steps=args.steps, **hist, ops_saved_per_layer=per_layer,
               max_abs_logit_diff={k: float((logits[(True, k)] - logits[(False, k)]).abs().max()) for k in metas},
               median_s={f"{k}_{'on' if on else 'off'}": statistics.median(times[(on, k)])
                         for on in (False, True) for k in metas},
               min_s={f"{k}_{'on' if on else 'off'}": min(times[(on, k)]) for on in (False, True) for k in metas},
               max_s={f"{k}_{'on' if on else 'off'}": max(times[(on, k)]) for on in (False, True) for k in metas},
               cpu_median_s={f"{k}_{'on' if on else 'off'}": statistics.median(cpu[(on, k)])
                             for on in (False, True) for k in metas},
               cpu_min_s={f"{k}_{'on' if on else 'off'}": min(cpu[(on, k)]) for on in (False, True) for k in metas},
               cpu_max_s={f"{k}_{'on' if on else 'off'}": max(cpu[(on, k)]) for on in (False, True) for k in metas},
               compile_s={("on" if on else "off"): runs[on]["compile_s"] for on in (False, True)})
    print(f"MLAPO at deepseek-r1-tp8 ({LAYERS} layers, fp32, {args.lowering}); median of {args.steps} steps")
    print(f"| step | off median [min, max] (s) | on median [min, max] (s) | on / off (medians) |\n|---|---|---|---|")
    for k in metas:
        a, b = out["median_s"][f"{k}_off"], out["median_s"][f"{k}_on"]
        span = {on: f"[{out['min_s'][f'{k}_{on}']:.4f}, {out['max_s'][f'{k}_{on}']:.4f}]" for on in ("off", "on")}
        print(f"| {k} ({metas[k].num_tokens} tokens) | {a:.4f} {span['off']} | {b:.4f} {span['on']} | {b / a:.3f} |")
    print("process CPU seconds per step (all threads):")
    for k in metas:
        a, b = out["cpu_median_s"][f"{k}_off"], out["cpu_median_s"][f"{k}_on"]
        span = {on: f"[{out['cpu_min_s'][f'{k}_{on}']:.4f}, {out['cpu_max_s'][f'{k}_{on}']:.4f}]" for on in ("off", "on")}
        print(f"| {k} CPU | {a:.4f} {span['off']} | {b:.4f} {span['on']} | {b / a:.3f} |")
    print(f"graph ops: {hist['ops_before']} -> {hist['ops_after']} ({per_layer:.1f} fewer per layer; "
          f"{hist['rewrites']} layers rewritten, {hist['writes_folded']} cache writes folded)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
