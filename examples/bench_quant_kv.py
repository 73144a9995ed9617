"""Quantised KV cache (issue 39): the capacity table, greedy drift against the unquantised
model, and the CPU decode bandwidth row (docs/quant_kv.md holds the figures).

    python -m examples.bench_quant_kv table                 # dtype x dcp -> KV bytes and tokens per rank
    python -m examples.bench_quant_kv greedy --steps 32     # example models: first divergence + logit margin
    python -m examples.bench_quant_kv bandwidth --context 16384 --runs 7

`table` allocates the caches on the meta device with `allocate_kv_cache` (scales counted as
allocated) at real model shapes; `greedy` runs the tiny example models (random weights,
fp32) on one device with kv_cache_dtype "auto" and each quantised dtype; `bandwidth` times
`cp::paged_attention_lse` (the CPU kernel) on one decode token per request at a 16k context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import cp_compile
import cp_compile.ops  # noqa: F401
from cp_compile.runtime.kv_cache import KVCacheSpec, allocate_kv_cache
from examples.serving import Schedule, layer_caches, run_schedule

DTYPES = ("auto", "fp8_e4m3", "int8")
# Real per-rank shapes, each config validated (GQA DCP needs dcp | tp // num_kv_heads):
# Qwen3-235B-A22B-style GQA at tp 32 (94 layers, 64 query / 4 KV heads -> 1 KV head per rank, D 128);
# DeepSeek-V3-style MLA at tp 8 (61 layers, one 512 + 64 latent per token, replicated over TP);
# DeepSeek-V3.2-style SFA at tp 8: the same latent plus the lightning indexer's keys (128 per token
# and layer, in the model's dtype, replicated on every rank: each rank holds every context token's),
# whose DCP needs dcp == tp (rows at other dcp are refused by validate_for and left out).
MODELS = {"GQA Qwen3-235B tp32": (KVCacheSpec(num_layers=94, kind="gqa", head_dim=128, num_kv_heads_per_rank=1), 32,
                                  cp_compile.AttentionSpec("gqa", 64, 4)),
          "MLA DeepSeek-V3 tp8": (KVCacheSpec(num_layers=61, kind="mla", latent_dim=576), 8,
                                  cp_compile.AttentionSpec("mla", 128)),
          "SFA DeepSeek-V3.2 tp8": (KVCacheSpec(num_layers=61, kind="sfa", latent_dim=576, index_dim=128), 8,
                                    cp_compile.AttentionSpec("sfa", 128, has_indexer=True))}


def table(budget_gib: float, dcps: tuple[int, ...]) -> list[dict]:
    rows = []
    for name, (spec, tp, attention) in MODELS.items():
        base = None
        for dt in DTYPES:
            for dcp in dcps:
                cfg = cp_compile.CPConfig(tensor_parallel_size=tp, decode_context_parallel_size=dcp, block_size=128,
                                          kv_cache_dtype=dt)
                try:
                    cfg.validate_for(attention)
                except cp_compile.ConfigError:
                    continue  # SFA DCP at dcp != tp: not a configuration the project runs
                cache = allocate_kv_cache(cfg, spec, 1024, dtype=torch.bfloat16, device="meta", attention=attention)
                stored = cache.sharded_bytes / cache.tokens_per_rank  # bytes per token this rank stores
                # The replicated indexer keys: every context token's on every rank (virtual blocks).
                index = cache.replicated_bytes / (cache.num_blocks * cfg.virtual_block_size)
                per_token = stored / dcp + index  # bytes on one rank per token of context (the group holds dcp x)
                base = base or per_token  # the first row: bf16 ("auto"), dcp 1
                budget = budget_gib * 2**30
                rows.append(dict(model=name, dtype="bf16" if dt == "auto" else dt, dcp=dcp, stored=stored,
                                 scale_bytes=cache.scale_bytes / cache.tokens_per_rank, index=index,
                                 per_token=per_token, ratio=per_token / base,
                                 tokens_stored=int(budget // (stored + dcp * index)),
                                 context_tokens=int(budget // per_token)))
    return rows


def _greedy(hf, kv_dtype: str, steps: int):
    from examples.models.tiny import example_from_config
    sd = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    model = example_from_config(hf.config, sd)
    cfg = cp_compile.CPConfig(block_size=16, kv_cache_dtype=kv_dtype)
    cache = allocate_kv_cache(cfg, model.kv_cache_spec(), 16)
    g = torch.Generator().manual_seed(0)
    prompts = {0: torch.randint(0, hf.config.vocab_size, (9,), generator=g).tolist(),
               1: torch.randint(0, hf.config.vocab_size, (5,), generator=g).tolist()}
    sched = Schedule(prompts=prompts, joins={0: [0, 1]}, num_steps=steps + 1)  # prefill + `steps` decodes
    return run_schedule(model, layer_caches(cache), cfg, 16, sched, max_blocks_per_req=8)


def greedy(steps: int) -> list[dict]:
    from examples.models.tiny import hf_deepseek_v3, hf_qwen3
    rows = []
    for name, hf in (("qwen3 (GQA)", hf_qwen3(num_kv_heads=2, num_heads=4)),
                     ("deepseek-v3 (MLA)", hf_deepseek_v3(q_lora_rank=None, num_heads=4))):
        ref = _greedy(hf, "auto", steps)
        for dt in DTYPES[1:]:
            got = _greedy(hf, dt, steps)
            first, worst, margin = None, 0.0, float("inf")
            for step, (a, b) in enumerate(zip(ref, got)):
                if a.next_tokens != b.next_tokens:
                    req = next(i for i, (x, y) in enumerate(zip(a.next_tokens, b.next_tokens)) if x != y)
                    top = a.last_logits[req].topk(2).values
                    first = dict(step=step, request=a.req_ids[req], ref_token=a.next_tokens[req],
                                 quant_token=b.next_tokens[req], ref_margin=float(top[0] - top[1]),
                                 logit_diff=float((a.last_logits[req] - b.last_logits[req]).abs().max()))
                    break
                worst = max(worst, float((a.last_logits - b.last_logits).abs().max()))
                top2 = a.last_logits.topk(2, dim=-1).values  # [B, 2]
                margin = min(margin, float((top2[:, 0] - top2[:, 1]).min()))
            # worst / margin: over the steps before the first divergence (all steps when equal)
            rows.append(dict(model=name, dtype=dt, steps=steps, equal=first is None, first_divergence=first,
                             max_logit_diff_before=worst, min_ref_margin_before=margin))
    return rows


def bandwidth(context: int, runs: int, batch: int) -> list[dict]:
    """One decode token per request over `context` keys, Qwen3-8B per-rank GQA shape at tp 1
    (32 query heads, 8 KV heads, D 128), block 128, q bf16."""
    Hq, Hkv, D, BS = 32, 8, 128, 128
    pages = context // BS
    g = torch.Generator().manual_seed(0)
    bt = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    kv_lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, Hq, D, generator=g).to(torch.bfloat16)
    setups = {}
    for name in ("fp32", "bf16", "int8", "fp8_e4m3"):
        k = torch.randn(batch * pages, BS, Hkv, D, generator=g)
        v = torch.randn(batch * pages, BS, Hkv, D, generator=g)
        if name in ("fp32", "bf16"):
            dt = torch.float32 if name == "fp32" else torch.bfloat16
            args: tuple = (k.to(dt), v.to(dt))
            scales: tuple = ()
        else:
            dt = torch.int8 if name == "int8" else torch.float8_e4m3fn
            caches = [torch.zeros_like(k, dtype=dt), torch.zeros_like(v, dtype=dt)]
            scales = (torch.zeros(batch * pages, BS, Hkv), torch.zeros(batch * pages, BS, Hkv))
            slots = torch.arange(batch * pages * BS)
            torch.ops.cp.quant_cache_write(k.flatten(0, 1), caches[0], scales[0], slots)  # [tokens, Hkv, D]
            torch.ops.cp.quant_cache_write(v.flatten(0, 1), caches[1], scales[1], slots)
            args = tuple(caches)
        del k, v
        setups[name] = (args, scales)
        torch.ops.cp.paged_attention_lse(q, *args, bt, qsl, kv_lens, D ** -0.5, *scales)  # warm-up
    # Runs interleaved over the caches, so a change of machine load hits every row alike.
    times: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(runs):
        for name, (args, scales) in setups.items():
            t0 = time.perf_counter()
            torch.ops.cp.paged_attention_lse(q, *args, bt, qsl, kv_lens, D ** -0.5, *scales)
            times[name].append(time.perf_counter() - t0)
    rows = []
    for name, (args, scales) in setups.items():
        nbytes = sum(t.numel() * t.element_size() for t in args + scales)
        ts = times[name]
        med = statistics.median(ts)
        rows.append(dict(cache=name, context=context, batch=batch, kv_mib=nbytes / 2**20, median_ms=med * 1e3,
                         min_ms=min(ts) * 1e3, max_ms=max(ts) * 1e3, gb_per_s=nbytes / med / 1e9))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("--budget-gib", type=float, default=16.0, help="KV memory per rank")
    t.add_argument("--dcp", type=int, nargs="+", default=[1, 2, 4, 8])
    gr = sub.add_parser("greedy")
    gr.add_argument("--steps", type=int, default=32)
    b = sub.add_parser("bandwidth")
    b.add_argument("--context", type=int, default=16384)
    b.add_argument("--runs", type=int, default=7)
    b.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    if a.cmd == "table":
        print(f"| model | KV dtype | dcp | bytes / stored token (of which scales) | indexer bytes / context token "
              f"/ rank | KV bytes / context token / rank | x bf16 dcp 1 | tokens stored / rank in {a.budget_gib:g} GiB "
              "| context tokens the group holds |\n|---|---|---|---|---|---|---|---|---|")
        for r in table(a.budget_gib, tuple(a.dcp)):
            print(f"| {r['model']} | {r['dtype']} | {r['dcp']} | {r['stored']:.0f} ({r['scale_bytes']:.0f}) | "
                  f"{r['index']:.0f} | {r['per_token']:.1f} | {r['ratio']:.4f} | {r['tokens_stored']:,} | "
                  f"{r['context_tokens']:,} |")
    elif a.cmd == "greedy":
        for r in greedy(a.steps):
            print(r)
    else:
        print("| cache | context | batch | KV MiB read | median ms (min-max) | GB/s |\n|---|---|---|---|---|---|")
        for r in bandwidth(a.context, a.runs, a.batch):
            print(f"| {r['cache']} | {r['context']} | {r['batch']} | {r['kv_mib']:.0f} | {r['median_ms']:.1f} "
                  f"({r['min_ms']:.1f}-{r['max_ms']:.1f}) | {r['gb_per_s']:.2f} |")


if __name__ == "__main__":
    main()
