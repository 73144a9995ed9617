"""MLAPO benchmark: the `mla_preprocess` pass off vs on, side by side in one run.

    python -m examples.bench_mla_preprocess [--tokens 256] [--decode-batch 8] [--steps 5] [--lowering inductor]
                                            [--threads 1]

The DeepSeek-R1 per-rank shape at tp 8 (examples/bench/shapes.py `deepseek-r1-tp8`:
hidden 7168, 16 heads of nope 128 + rope 64, q_lora 1536, latent 512 + 64, MLP 2304),
2 layers, small vocab, fp32 on this machine's device. Both models hold the same
weights and compile with the same lowering; prefill (one request of `--tokens`) and
decode (`--decode-batch` requests of one token on a `--tokens` context) steps run
alternately off / on / on_reference (the pass on, the op's CPU kernel swapped for the
torch reference body: the kernel's share), and the table gives the median step time of each and the
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
from cp_compile.runtime.metadata_build import BlockAllocator, build_attention_metadata
from examples.bench.shapes import PRESETS
from examples.models.deepseek_mla import DeepseekMLAModel
from cp_compile.ops.mla_preprocess import reference as mla_preprocess_ref
from cp_compile.ops.mla_preprocess.ops import OPS as MLA_OPS

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


SIDES = ("off", "on", "on_reference")  # pass off; on with the op's CPU kernel; on with the reference body


def _use_cpu_kernel(side: str) -> None:
    """On CPU, run `cp::mla_preprocess` through its CPU kernel (`on`) or the torch reference body
    (`on_reference`), to charge the kernel's share of the step (the same compiled graph)."""
    fn = mla_preprocess_ref.mla_preprocess if side == "on_reference" else MLA_OPS[0].cpu
    torch.library.register_kernel("cp::mla_preprocess", "cpu", fn)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lowering", default="inductor")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch intra-op threads (0: torch's default). With more than one, process CPU "
                         "seconds include the OpenMP workers' spin-waits between kernels")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    block = 16
    num_blocks = (args.tokens // block + 2) * args.decode_batch + 4
    base = _model()
    runs = {}
    for on in (False, True):
        model = _model()
        model.load_state_dict(base.state_dict())
        cfg = cp_compile.CPConfig(block_size=block, enable_mla_preprocess=on)
        compiled = cp_compile.compile_model(model, lowering=args.lowering, config=cfg)
        for side in (("on", "on_reference") if on else ("off",)):
            cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), num_blocks)
            runs[side] = dict(fn=compiled, cache=cache, compile_s=0.0)
    metas = _steps(args.tokens, args.decode_batch, block, num_blocks)
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    logits: dict[tuple[str, str], torch.Tensor] = {}
    try:
        for step in range(args.steps + 1):  # step 0 compiles (prefill and decode share the graph)
            for kind, meta in metas.items():
                ids = torch.arange(meta.num_tokens) % 1000
                for side in SIDES:
                    r = runs[side]
                    _use_cpu_kernel(side)
                    t, c = time.perf_counter(), time.process_time()
                    logits[(side, kind)] = r["fn"](ids, meta.positions, r["cache"].layers, meta)
                    dt, dc = time.perf_counter() - t, time.process_time() - c
                    if step == 0:
                        r["compile_s"] += dt
                    else:
                        times.setdefault((side, kind), []).append(dt)
                        # CPU seconds of this process (all threads): less sensitive than wall time
                        # to other jobs on a shared machine.
                        cpu.setdefault((side, kind), []).append(dc)
    finally:
        _use_cpu_kernel("on")
    hist = {}
    for on in (False, True):
        pm = runs["on" if on else "off"]["fn"].backend.pass_managers[0]
        rec = {h.name: h for h in pm.history}
        if on:
            mla = rec["mla_preprocess"]
            hist = dict(rewrites=mla.rewrites, writes_folded=rec["mla_preprocess_cache_write"].rewrites,
                        ops_before=sum(mla.before.values()), ops_after=sum(rec["mla_preprocess_cache_write"].after
                                                                           .values()))
    per_layer = (hist["ops_before"] - hist["ops_after"]) / LAYERS

    def stat(f, d) -> dict:
        return {f"{k}_{side}": f(d[(side, k)]) for side in SIDES for k in metas}

    out = dict(shape="deepseek-r1-tp8", layers=LAYERS, tokens=args.tokens, decode_batch=args.decode_batch,
               lowering=args.lowering, steps=args.steps, threads=torch.get_num_threads(), **hist,
               ops_saved_per_layer=per_layer,
               max_abs_logit_diff={f"{k}_{side}": float((logits[(side, k)] - logits[("off", k)]).abs().max())
                                   for side in SIDES[1:] for k in metas},
               median_s=stat(statistics.median, times), min_s=stat(min, times), max_s=stat(max, times),
               cpu_median_s=stat(statistics.median, cpu), cpu_min_s=stat(min, cpu), cpu_max_s=stat(max, cpu),
               compile_s={side: runs[side]["compile_s"] for side in SIDES})
    print(f"MLAPO at deepseek-r1-tp8 ({LAYERS} layers, fp32, {args.lowering}, {out['threads']} threads); "
          f"median [min, max] of {args.steps} steps, sides interleaved")
    for label, med, lo, hi in (("wall s", "median_s", "min_s", "max_s"),
                               ("process CPU s (all threads)", "cpu_median_s", "cpu_min_s", "cpu_max_s")):
        print(f"| step, {label} | off | on | on_reference | on / off | on_reference / off |\n|---|---|---|---|---|---|")
        for k in metas:
            cell = {side: f"{out[med][f'{k}_{side}']:.4f} [{out[lo][f'{k}_{side}']:.4f}, "
                          f"{out[hi][f'{k}_{side}']:.4f}]" for side in SIDES}
            a = out[med][f"{k}_off"]
            print(f"| {k} ({metas[k].num_tokens} tokens) | {cell['off']} | {cell['on']} | {cell['on_reference']} "
                  f"| {out[med][f'{k}_on'] / a:.3f} | {out[med][f'{k}_on_reference'] / a:.3f} |")
    print(f"graph ops: {hist['ops_before']} -> {hist['ops_after']} ({per_layer:.1f} fewer per layer; "
          f"{hist['rewrites']} layers rewritten, {hist['writes_folded']} cache writes folded)")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
