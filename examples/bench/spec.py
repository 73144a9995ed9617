"""Speculative decoding in the decode benchmark (`--spec-tokens k`): on vs off, side by side.

One world per (dcp, merge) of `tp` ranks builds the tiny target and its proposer
(`--proposer`: the MTP layer for MLA / SFA, a tiny draft or the layer-skip draft for
GQA; `examples/spec.py`), compiles both with cp_ascend (the target's verify graph,
the draft's catch-up and decode graphs), and for each (context, batch) generates
from `batch` random prompts of `context` tokens twice per side, off / on / on / off
(ABBA, so a slow spell of a shared machine hits both), after one warm-up generation
per side that compiles every graph. Per side it reports the acceptance rate, tokens
per request and target step, and TPOT: each round's wall time (draft steps, the
verify step, acceptance and rollback, as the runtime sees them; max over ranks)
divided by the tokens per request it emitted, pooled over the rounds of the two
timed generations. Greedy output of the two sides is checked equal.
"""

from __future__ import annotations

import time
from typing import Any

import torch

import cp_compile
from examples import spec
from examples.bench.args import BenchArgs
from examples.bench.launch import World, log
from examples.bench.shapes import ModelSource
from examples.bench.timing import max_over_ranks


def spec_source(args: BenchArgs) -> ModelSource:
    """The tiny target with its proposer's weights (MTP tensors or the draft), built once."""
    from examples.bench.models import build_hf_model, hf_state_dict

    hf = build_hf_model(args.model, args.tp)
    sd, dcfg, dsd = spec.proposer_weights(args.proposer, hf.config, hf_state_dict(hf))
    src = ModelSource("tiny", args.model, hf.config.num_hidden_layers, hf.config, sd)
    src.draft_hf = None if dcfg is None else (dcfg, dsd)  # type: ignore[attr-defined]
    return src


def _generate(models: spec.SpecModels, cfg: cp_compile.CPConfig, num_blocks: int, width: int,
              prompts: dict[int, list[int]], max_new: int, device: torch.device) -> Any:
    dec = spec.decoder(models, cfg, num_blocks, max_blocks_per_req=width, device=str(device))
    return dec.generate(prompts, max_new)


def spec_world(rank: int, world_size: int, args: BenchArgs, world: World, source: ModelSource,
               device: torch.device) -> list[dict[str, Any]]:
    """One (dcp, merge): spec off (k = 0) and on (k = args.spec_tokens) on the same compiled target."""
    dcp, merge = world
    k = args.spec_tokens
    cfg = cp_compile.CPConfig(tensor_parallel_size=args.tp, decode_context_parallel_size=dcp,
                              cp_kv_cache_interleave_size=args.interleave, block_size=args.block_size,
                              dcp_merge=merge if dcp > 1 else "ag_rs")
    state = cp_compile.init_parallel(cfg, device=device)
    try:
        max_new = args.steps * (k + 1)
        per_req = max(args.context) + max_new + k + 1
        width = -(-per_req // cfg.virtual_block_size)
        num_blocks = width * max(args.batch)
        t0 = time.perf_counter()
        sides = {"off": spec.build(cfg, source.hf_config, source.state_dict, None, 0, num_blocks, state.layout.tp.rank,
                                   state.tp_group, lowering=args.lowering, max_blocks_per_req=width,
                                   device=str(device)),
                 "on": spec.build(cfg, source.hf_config, source.state_dict, args.proposer, k, num_blocks,
                                  state.layout.tp.rank, state.tp_group, lowering=args.lowering,
                                  draft_lowering=args.lowering, draft_hf=source.draft_hf,  # type: ignore[attr-defined]
                                  max_blocks_per_req=width, device=str(device))}
        log(rank, f"[dcp={dcp} spec k={k} {args.proposer}] models built in {time.perf_counter() - t0:.1f} s")
        rows = []
        for context in args.context:
            for batch in args.batch:
                g = torch.Generator().manual_seed(context * 7 + batch)
                prompts = {r: torch.randint(0, source.vocab_size, (context,), generator=g).tolist()
                           for r in range(batch)}
                for side in ("off", "on"):  # warm-up, as long as a timed run: every batch kind it meets compiles
                    _generate(sides[side], cfg, num_blocks, width, prompts, max_new, device)
                warm = {s: sides[s].graphs() for s in sides}
                runs: dict[str, list[Any]] = {"off": [], "on": []}
                for side in ("off", "on", "on", "off"):
                    runs[side].append(_generate(sides[side], cfg, num_blocks, width, prompts, max_new, device))
                for side, res in runs.items():
                    assert res[0].tokens == res[1].tokens
                    round_s = max_over_ranks([t for r in res for t in r.stats.round_s], device)
                    toks = [n for r in res for n in r.stats.round_tokens]
                    st = res[0].stats
                    row = dict(bench="decode_spec", shape=args.shape, model=args.model, tp=args.tp, dcp=dcp,
                               merge=merge, interleave=args.interleave, lowering=args.lowering, context=context,
                               batch=batch, spec_tokens=k if side == "on" else 0,
                               proposer=args.proposer if side == "on" else "none",
                               rounds=len(round_s), tokens_generated=max_new,
                               acceptance_rate=st.acceptance_rate, tokens_per_step=st.tokens_per_step,
                               tpot_ms=1e3 * sum(round_s) / sum(toks), step_ms=1e3 * sum(round_s) / len(round_s),
                               graphs=sides[side].graphs(),
                               recompiled_in_timed_steps=sides[side].graphs() != warm[side],
                               tokens=res[0].tokens)
                    rows.append(row)
                assert runs["off"][0].tokens == runs["on"][0].tokens, "speculation changed the greedy tokens"
                on, off = rows[-1], rows[-2]
                on["tpot_ratio_on_off"] = on["tpot_ms"] / off["tpot_ms"]
                log(rank, f"[dcp={dcp}] context={context} batch={batch}: TPOT off {off['tpot_ms']:.2f} ms, "
                          f"on {on['tpot_ms']:.2f} ms (acceptance {on['acceptance_rate']:.2f}, "
                          f"{on['tokens_per_step']:.2f} tokens/step), tokens equal")
        return rows
    finally:
        cp_compile.destroy_parallel()
        torch._dynamo.reset()


def format_spec_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'dcp':>3} {'context':>7} {'batch':>5} {'spec k':>6} {'proposer':>10} {'accept':>6} "
            f"{'tok/step':>8} {'step ms':>8} {'TPOT ms':>8} {'on/off':>6} {'graphs':>30} recompiled")
    lines = [head, "-" * len(head)]
    for r in rows:
        ratio = f"{r['tpot_ratio_on_off']:.2f}" if "tpot_ratio_on_off" in r else ""
        graphs = ",".join(f"{m}:{sum(v.values())}" for m, v in r["graphs"].items())
        lines.append(f"{r['dcp']:>3} {r['context']:>7} {r['batch']:>5} {r['spec_tokens']:>6} {r['proposer']:>10} "
                     f"{r['acceptance_rate']:>6.2f} {r['tokens_per_step']:>8.2f} {r['step_ms']:>8.2f} "
                     f"{r['tpot_ms']:>8.2f} {ratio:>6} {graphs:>30} {r['recompiled_in_timed_steps']}")
    return "\n".join(lines)
