"""Quick start: a plain PyTorch model, compiled with the cp_ascend backend, runs DCP.

Spawns `--tp` CPU ranks (gloo), builds the tiny Qwen3-style example model (random
weights, HF layout) TP-sharded on each rank, opts it in with `@cp_compile.cp_module`
(which compiles forward with `backend="cp_ascend"`, fullgraph, Inductor), and runs a
prefill plus greedy decode steps while requests join and leave. The same schedule
runs on one device in eager mode; the script prints both token streams, the
largest logit difference, what the pass rewrote, and the per-rank KV-cache bytes
against the dcp = 1 baseline.

    python -m examples.quickstart            # tp=2, dcp=2 (from the repository root)
    python -m examples.quickstart --tp 4 --dcp 4 --model mla
    python -m examples.quickstart --model sfa  # DeepSeek-V3.2-style sparse MLA (needs dcp == tp)
    python -m examples.quickstart --tp 1 --dcp 1 --pcp 2   # PCP: prefill tokens split over 2 ranks
    python -m examples.quickstart --spec-tokens 3           # speculative decoding (GQA + draft model)
    python -m examples.quickstart --model mla --spec-tokens 2 --pcp 2   # MTP, pcp 2 + dcp 2 (4 ranks)

With `--spec-tokens k` the ranks instead generate greedily with speculative decoding
(`cp_compile.serving.spec_decode`: k drafts per request from the proposer, one verify step of
k + 1 tokens per request on the sharded cache, rejected tokens' blocks given back)
and the script checks the tokens against the single-device run without speculation,
printing the acceptance rate, tokens per step and the graphs compiled per batch kind.

With `--pcp P` the world is tp * P ranks: prefill steps run a token-sharded graph
(each PCP rank computes its head-tail share of the new tokens), decode steps a
graph that attends the cache sharded over pcp * dcp ranks (docs/pcp.md).

Run as a module from the repository root, so `examples.*` imports without path
tricks (the ranks it spawns import this module by the same name).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import cp_compile
from cp_compile.base.comm_stats import decode_comm_bytes_per_layer
from cp_compile.testing.multirank import run_on_ranks
from examples.models.deepseek_mla import DeepseekMLAConfig, DeepseekMLAModel
from examples.models.deepseek_sfa import DeepseekSFAConfig, DeepseekSFAModel
from examples.models.qwen3 import Qwen3Config, Qwen3Model
from examples.models.tiny import VOCAB, example_from_config, hf_deepseek_sfa, hf_deepseek_v3, hf_qwen3
from examples import spec
from examples.serving import layer_caches, run_schedule, tiny_schedule

BLOCK = 4
NUM_BLOCKS = 12


# The user's model code is unchanged; the decorator opts it in. Subclasses here only
# because the example models are also used uncompiled by the reference run.
@cp_compile.cp_module
class CompiledQwen3(Qwen3Model):
    pass


@cp_compile.cp_module
class CompiledMLA(DeepseekMLAModel):
    pass


@cp_compile.cp_module(indexer="self_attn.indexer")
class CompiledSFA(DeepseekSFAModel):
    pass


def _rank_main(rank: int, world: int, kind: str, dcp: int, steps: int, hf_config, state_dict, pcp: int = 1) -> dict:
    tp = world // pcp
    cfg = cp_compile.CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                              prefill_context_parallel_size=pcp, block_size=BLOCK)
    state = cp_compile.init_parallel(cfg, device="cpu")
    if kind == "qwen3":
        model = CompiledQwen3(Qwen3Config.from_hf(hf_config), tp, state.layout.tp.rank, state.tp_group)
    elif kind == "mla":
        model = CompiledMLA(DeepseekMLAConfig.from_hf(hf_config), tp, state.layout.tp.rank, state.tp_group)
    else:
        model = CompiledSFA(DeepseekSFAConfig.from_hf(hf_config), tp, state.layout.tp.rank, state.tp_group)
    model.load_hf_state_dict(state_dict)
    cache = cp_compile.allocate_kv_cache(cfg, model.kv_cache_spec(), NUM_BLOCKS, attention=model.attention_spec())
    # The plain-TP baseline (dcp = pcp = 1) for the same token capacity, on the meta device: shapes, no memory.
    base_cfg = cfg.replace(decode_context_parallel_size=1, prefill_context_parallel_size=1,
                           block_size=cfg.virtual_block_size)
    base = cp_compile.allocate_kv_cache(base_cfg, model.kv_cache_spec(), NUM_BLOCKS, device="meta")
    t0 = time.perf_counter()
    # SFA: each layer's tuple also holds its replicated indexer cache (cache.replicated).
    results = run_schedule(model, layer_caches(cache), cfg, NUM_BLOCKS, tiny_schedule(VOCAB, num_steps=steps))
    # Every compiled graph's passes (one graph per batch kind at pcp > 1: prefill and decode).
    pms = [pm for b in model.cp_compiled.backends.values() for pm in b.pass_managers]
    history = [h for pm in pms for h in pm.history]
    return dict(results=results, seconds=time.perf_counter() - t0, kv_bytes=cache.sharded_bytes,
                base_bytes=base.sharded_bytes, base_tokens=base.tokens_per_rank,
                index_bytes=cache.replicated_bytes, base_index_bytes=base.replicated_bytes,
                tokens_per_rank=cache.tokens_per_rank, rewrites=[(h.name, h.rewrites, h.after) for h in history],
                graphs=len(pms))


SPEC_NEW_TOKENS = 12
SPEC_BLOCKS = 40


def _spec_prompts() -> dict[int, list[int]]:
    g = torch.Generator().manual_seed(0)
    return {r: torch.randint(0, VOCAB, (n,), generator=g).tolist() for r, n in {0: 7, 1: 3, 2: 12}.items()}


def _spec_rank(rank: int, world: int, tp: int, dcp: int, pcp: int, k: int, proposer: str, hf_config, sd,
               draft_hf) -> dict:
    cfg = cp_compile.CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                              prefill_context_parallel_size=pcp, block_size=BLOCK)
    state = cp_compile.init_parallel(cfg, device="cpu")
    models = spec.build(cfg, hf_config, sd, proposer, k, SPEC_BLOCKS, state.layout.tp.rank, state.tp_group,
                        lowering="inductor", draft_lowering="inductor", draft_hf=draft_hf, max_blocks_per_req=10)
    t0 = time.perf_counter()
    res = spec.decoder(models, cfg, SPEC_BLOCKS, max_blocks_per_req=10).generate(_spec_prompts(), SPEC_NEW_TOKENS)
    kinds = {m: {str(kind): [str(c.batch_kind) for c in b.contexts] for kind, b in comp.backends.items()}
             for m, comp in models.compiled.items()}
    return dict(tokens=res.tokens, rate=res.stats.acceptance_rate, tps=res.stats.tokens_per_step,
                steps=res.stats.steps, graphs=models.graphs(), kinds=kinds, seconds=time.perf_counter() - t0)


def _spec_main(args: argparse.Namespace, hf, sd: dict) -> int:
    proposer = spec.default_proposer(hf.config.model_type)
    sd, dcfg, dsd = spec.proposer_weights(proposer, hf.config, sd)
    draft_hf = None if dcfg is None else (dcfg, dsd)
    world = args.tp * args.pcp
    print(f"model={args.model} tp={args.tp} dcp={args.dcp} pcp={args.pcp} speculative decoding: k={args.spec_tokens} "
          f"draft tokens per request from {proposer!r}; spawning {world} gloo ranks, compiling with Inductor...")
    per_rank = run_on_ranks(_spec_rank, world, args.tp, args.dcp, args.pcp, args.spec_tokens, proposer, hf.config,
                            sd, draft_hf, timeout=1800)
    ref_cfg = cp_compile.CPConfig(block_size=BLOCK * args.dcp * args.pcp)
    ref = spec.decoder(spec.build(ref_cfg, hf.config, sd, None, 0, SPEC_BLOCKS, max_blocks_per_req=10), ref_cfg,
                       SPEC_BLOCKS, max_blocks_per_req=10).generate(_spec_prompts(), SPEC_NEW_TOKENS)
    ok = all(r["tokens"] == ref.tokens for r in per_rank)
    print("\nrequest  single-device greedy, no speculation        speculative (rank 0)")
    for rid, want in ref.tokens.items():
        got = per_rank[0]["tokens"][rid]
        print(f"{rid:7d}  {str(want):40s}  {str(got):40s} {'ok' if got == want else 'MISMATCH'}")
    r0 = per_rank[0]
    print(f"\nacceptance rate {r0['rate']:.2f}, tokens per request and target step {r0['tps']:.2f} "
          f"({r0['steps']} verify steps for {SPEC_NEW_TOKENS} tokens per request)")
    print(f"graphs compiled per model and batch kind (rank 0): {r0['graphs']}")
    print(f"\nspeculative decoding {'MATCHES' if ok else 'DOES NOT MATCH'} the single-device greedy run without "
          f"speculation (rank 0 wall time {r0['seconds']:.1f} s incl. compile)")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["qwen3", "mla", "sfa"], default="qwen3")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--dcp", type=int, default=2)
    ap.add_argument("--pcp", type=int, default=1, help="prefill context parallel size (world = tp * pcp)")
    ap.add_argument("--steps", type=int, default=8, help="prefill + decode steps")
    ap.add_argument("--spec-tokens", type=int, default=0,
                    help="> 0: speculative decoding with k draft tokens per request (MTP for mla / sfa, a tiny "
                         "draft model for qwen3)")
    args = ap.parse_args()
    if args.spec_tokens < 0:
        ap.error(f"--spec-tokens must be >= 0, got {args.spec_tokens}")
    if args.model == "sfa" and args.pcp > 1:
        ap.error("--model sfa runs at --pcp 1 (PCP covers GQA and MLA)")
    if args.model == "sfa" and args.dcp not in (1, args.tp):
        ap.error(f"--model sfa needs --dcp == --tp (SFA DCP with a replicated indexer), got tp={args.tp} "
                 f"dcp={args.dcp}")

    heads = max(4, args.tp)
    if args.model == "qwen3":
        hf = hf_qwen3(num_kv_heads=max(1, args.tp // args.dcp), num_heads=heads)
    elif args.model == "mla":
        hf = hf_deepseek_v3(q_lora_rank=None, num_heads=heads)
    else:
        hf = hf_deepseek_sfa("deepseek_v32", num_heads=heads)
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if args.spec_tokens:
        return _spec_main(args, hf, sd)
    print(f"cp_ascend registered as a torch.compile backend: {'cp_ascend' in torch._dynamo.list_backends()}")
    n = args.dcp * args.pcp  # ranks the KV cache is sharded over
    world = args.tp * args.pcp
    print(f"model={args.model} tp={args.tp} dcp={args.dcp} pcp={args.pcp} block_size={BLOCK} "
          f"(virtual block {BLOCK * n} tokens); spawning {world} gloo ranks, compiling with Inductor...")
    per_rank = run_on_ranks(_rank_main, world, args.model, args.dcp, args.steps, hf.config, sd, args.pcp,
                            timeout=1200)

    # Single-device eager reference: same weights, same global metadata, pages of a whole virtual block.
    ref_model = example_from_config(hf.config, sd)
    ref_cfg = cp_compile.CPConfig(block_size=BLOCK * n)
    ref_cache = cp_compile.allocate_kv_cache(ref_cfg, ref_model.kv_cache_spec(), NUM_BLOCKS)
    ref = run_schedule(ref_model, layer_caches(ref_cache), ref_cfg, NUM_BLOCKS,
                       tiny_schedule(VOCAB, num_steps=args.steps))

    print(f"\nstep  requests   single-device tokens   {'PCP' if args.pcp > 1 else 'DCP'} tokens (rank 0)   "
          f"max |logit diff| over ranks")
    ok = True
    worst = 0.0
    for step, want in enumerate(ref):
        diffs = [(r["results"][step].last_logits - want.last_logits).abs().max().item() for r in per_rank]
        same = all(r["results"][step].next_tokens == want.next_tokens for r in per_rank)
        ok &= same and max(diffs) < 1e-4
        worst = max(worst, max(diffs))
        print(f"{step:4d}  {str(want.req_ids):9s}  {str(want.next_tokens):21s}  "
              f"{str(per_rank[0]['results'][step].next_tokens):20s}  {max(diffs):.2e} {'ok' if same else 'MISMATCH'}")

    # The passes that rewrote the attention (dcp_attention; sfa_dcp for the sparse model; pcp_attention
    # in the prefill graph at pcp > 1).
    for name, rewrites, after in per_rank[0]["rewrites"]:
        if rewrites == 0:
            continue
        colls = {k.split(".")[1]: v for k, v in after.items() if "_c10d_functional" in k and "wait" not in k}
        print(f"\npass {name}: {rewrites} nodes rewritten; graph now holds {colls}")
    print(f"graphs compiled per rank: {per_rank[0]['graphs']}")

    tag = f"dcp={args.dcp}" + (f" pcp={args.pcp}" if args.pcp > 1 else "")
    print("\nKV cache per rank (same token capacity: "
          f"{NUM_BLOCKS} blocks x {BLOCK * n} tokens = {NUM_BLOCKS * BLOCK * n} tokens)")
    for r, out in enumerate(per_rank):
        base_bytes = out["base_bytes"]
        print(f"  dcp=1 rank {r}  : {base_bytes:>9,d} bytes, {out['base_tokens']} tokens per rank (plain TP)")
    for r, out in enumerate(per_rank):
        base_bytes = out["base_bytes"]
        print(f"  {tag} rank {r}  : {out['kv_bytes']:>9,d} bytes, {out['tokens_per_rank']} tokens per rank "
              f"({out['kv_bytes'] / base_bytes:.3f} of baseline)")
    if args.model == "sfa":
        for r, out in enumerate(per_rank):
            print(f"  indexer cache rank {r}: {out['index_bytes']:>9,d} bytes at dcp={args.dcp}, "
                  f"{out['base_index_bytes']:,d} at dcp=1 (replicated: every rank holds every token's key)")

    heads_per_rank = heads // args.tp
    if args.model == "qwen3":
        qd, vd = hf.config.head_dim, hf.config.head_dim
    else:  # MLA and SFA gather [q_nope | q_pe] and merge latents
        qd, vd = hf.config.kv_lora_rank + hf.config.qk_rope_head_dim, hf.config.kv_lora_rank
    per_layer = decode_comm_bytes_per_layer(1, heads_per_rank, qd, vd, 4, n)
    print(f"\nDCP traffic (N = {n}) per decode token per layer per rank: {per_layer} bytes "
          f"(independent of context length)")
    print(f"\n{'PCP' if args.pcp > 1 else 'DCP'} compiled run {'MATCHES' if ok else 'DOES NOT MATCH'} the single-device run "
          f"(max |logit diff| {worst:.2e}; rank 0 wall time {per_rank[0]['seconds']:.1f} s incl. compile)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
