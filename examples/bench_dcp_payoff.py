"""What DCP buys at a fixed KV budget: dcp 1 vs dcp 2 through `cp_compile.LLM` (issue 38, items 3-4).

Same world (tp ranks), same `kv_cache_memory_bytes` per rank; only
`decode_context_parallel_size` changes. A seeded long-context trace (prompts long
relative to the budget, staggered wall-clock arrivals, short outputs) is driven
through the LLM's own driver with continuous batching (`Driver.step(may_join)`:
a request may join once its arrival time has passed, and is admitted when its
whole budget, prompt + max_tokens, fits in the free KV blocks). Per run:

- max concurrent requests: the most requests one step ran;
- output tokens/s: output tokens / (last finish - first arrival);
- TTFT (first token - arrival) and TPOT ((finish - first token) / (outputs - 1)), median and p99 over requests;
- KV usage over time: reserved blocks / pool blocks after each step (the plot).

Each figure is the median of `--runs` runs (one LLM per configuration, reused) with the
min-max spread. `--hf` adds item 4: the same trace through transformers' own
`generate` (static cache, static batches in arrival order, as many requests per
batch as the same KV bytes hold in HF's own cache layout; eager, or `--hf-compile`).

Shapes: the per-rank attention of Qwen3-235B-A22B (GQA) and DeepSeek-R1 (MLA) at
their tp 8 (examples/bench/shapes.py), scaled to fit 2 CPU cores: see SCALED below.

    python examples/bench_dcp_payoff.py --shape qwen3,mla --runs 3 --hf --plot docs/img/bench_dcp_payoff.png
    python examples/bench_dcp_payoff.py --shape tiny --runs 1      (the test's configuration)

Writes `--out` (JSON: one entry per shape, its dcp rows and the HF row) and prints a table.
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence as Seq

if not __package__:  # run as a script: make the repo root the import root (as `-m` would)
    sys.path[0] = str(Path(__file__).resolve().parents[1])


# ---- shapes -------------------------------------------------------------------------
# Per rank at the deployment's tp 8 (examples/bench/shapes.py), kept: the attention a
# rank runs and the KV a token costs it (Qwen3: 8 q heads, 1 KV head of 128; R1: 16
# heads over the 512 + 64 latent, nope 128, v 128). Scaled (so a trace runs in minutes
# on 2 shared cores): hidden 4096 / 7168 -> 512, the MLP per rank 1536 / 2304 -> 256,
# R1's q_lora 1536 -> 256, 2 layers (94 / 61), vocab 512, fp32.
# The issue's trace reaches 64k prompts + 256 outputs; transformers' configs default to
# 32k (Qwen3) / 4k (DeepSeek-V3), and the engine refuses a max_model_len above it.
MAX_POSITIONS = 131072


@dataclass(frozen=True)
class Scaled:
    name: str
    kind: str  # "qwen3" | "mla" | "tiny"
    source: str
    layers: int = 2
    hidden: int = 512
    heads_per_rank: int = 8
    mlp_per_rank: int = 256
    vocab: int = 512
    q_lora: int = 256

    def hf_config(self, tp: int) -> Any:
        import transformers

        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if self.kind == "tiny":
            return transformers.Qwen3Config(
                vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, rope_parameters=rope, tie_word_embeddings=False,
                dtype="float32", eos_token_id=None)
        if self.kind == "qwen3":  # one KV head in all: each TP rank holds it (as one of 4 heads on 2 of 8 ranks)
            return transformers.Qwen3Config(
                vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.mlp_per_rank * tp,
                num_hidden_layers=self.layers, num_attention_heads=self.heads_per_rank * tp, num_key_value_heads=1,
                head_dim=128, rope_parameters=rope, tie_word_embeddings=False, dtype="float32", eos_token_id=None,
                max_position_embeddings=MAX_POSITIONS)
        n = self.heads_per_rank * tp
        return transformers.DeepseekV3Config(
            vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.mlp_per_rank * tp,
            moe_intermediate_size=self.mlp_per_rank, num_hidden_layers=self.layers,
            first_k_dense_replace=self.layers, num_attention_heads=n, num_key_value_heads=n, q_lora_rank=self.q_lora,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_parameters=rope,
            tie_word_embeddings=False, dtype="float32", eos_token_id=None, max_position_embeddings=MAX_POSITIONS)


SCALED = {
    "tiny": Scaled("tiny", "tiny", "the CI model (examples/models/tiny.py sizes), 1 KV head of 16"),
    "qwen3": Scaled("qwen3-235b-a22b-tp8 (scaled)", "qwen3", "Qwen3-235B-A22B per rank at tp 8", heads_per_rank=8),
    "mla": Scaled("deepseek-r1-tp8 (scaled)", "mla", "DeepSeek-R1 per rank at tp 8", heads_per_rank=16),
    # The real per-rank widths (2 layers, vocab 512): hidden 4096 / 7168; the MLP a dense
    # stand-in for the rank's share of the active experts (Qwen3-235B-A22B: 8 of 128 experts
    # of 1536 over tp 8 = 1536; R1: its dense layers' 18432 / 8 = 2304); R1's q_lora 1536.
    # The same GEMMs on both sides of the engine-vs-`generate` comparison; the vocab is kept
    # small because the LM head is the same GEMM in both and is not what is compared.
    "qwen3_full": Scaled("qwen3-235b-a22b-tp8 (per-rank widths, 2 layers)", "qwen3",
                         "Qwen3-235B-A22B per rank at tp 8", hidden=4096, heads_per_rank=8, mlp_per_rank=1536),
    "mla_full": Scaled("deepseek-r1-tp8 (per-rank widths, 2 layers)", "mla", "DeepSeek-R1 per rank at tp 8",
                       hidden=7168, heads_per_rank=16, mlp_per_rank=2304, q_lora=1536),
}


def write_checkpoint(shape: Scaled, tp: int, path: str) -> str:
    from examples.random_checkpoint import write_random_checkpoint

    if not os.path.exists(os.path.join(path, "config.json")):
        write_random_checkpoint(shape.hf_config(tp), path)
    return path


# ---- the trace ----------------------------------------------------------------------
@dataclass(frozen=True)
class TraceSpec:
    requests: int
    prompt_min: int
    prompt_max: int
    out_min: int
    out_max: int
    interval_s: float  # arrivals: request i arrives at i * interval_s
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return self.prompt_max + self.out_max


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    max_tokens: int
    arrival: float


def make_trace(spec: TraceSpec, vocab: int) -> list[Request]:
    import torch

    g = torch.Generator().manual_seed(spec.seed)
    out = []
    for i in range(spec.requests):
        n = int(torch.randint(spec.prompt_min, spec.prompt_max + 1, (1,), generator=g))
        o = int(torch.randint(spec.out_min, spec.out_max + 1, (1,), generator=g))
        out.append(Request(torch.randint(3, vocab, (n,), generator=g).tolist(), o, i * spec.interval_s))
    return out


# ---- one run through LLM ------------------------------------------------------------
def pct(xs: Seq[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def run_trace(llm: Any, trace: list[Request], kv_params: list[dict] | None = None) -> dict[str, Any]:
    """Drive `trace` through `llm`'s driver with arrivals; per-request times, per-step KV use.
    `kv_params` (a kv_consumer `llm`): per request, the producer's `kv_transfer_params`."""
    from cp_compile import SamplingParams

    driver = llm.driver
    sched = driver.scheduler
    times: dict[int, list[float]] = {}
    seqs = []
    for i, req in enumerate(trace):
        sp = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
        seq, _ = llm.submit(req.prompt, sp, on_update=lambda s, _t: times.setdefault(s.rid, []).append(
            time.perf_counter()), kv_transfer_params=kv_params[i] if kv_params is not None else None)
        seqs.append(seq)
    arrival = {s.rid: r.arrival for s, r in zip(seqs, trace)}
    t0 = time.perf_counter()
    steps: list[dict[str, float]] = []
    while driver.has_work():
        now = time.perf_counter() - t0
        if not sched.running and sched.waiting and arrival[sched.waiting[0].rid] > now:
            time.sleep(min(0.05, arrival[sched.waiting[0].rid] - now))  # idle until the next arrival
            continue
        s0 = time.perf_counter()
        ran = driver.step(lambda seq: time.perf_counter() - t0 >= arrival[seq.rid])
        if ran:
            # KV in use during the step: the blocks its requests reserved (those that just
            # finished included; they are released by the next plan).
            used = sum(sched.blocks_for(s.budget) for s in ran) / sched.num_blocks
            steps.append(dict(t=time.perf_counter() - t0, step_s=time.perf_counter() - s0, batch=len(ran),
                              kv_used=used, prefill=any(len(s.output) == 1 for s in ran)))
    ttft, tpot, outs, finish = [], [], 0, 0.0
    for s in seqs:
        ts = [t - t0 for t in times[s.rid]]
        assert len(ts) == len(s.output) == s.max_tokens, (s.rid, len(ts), s.max_tokens)
        ttft.append(ts[0] - arrival[s.rid])
        if len(ts) > 1:
            tpot.append((ts[-1] - ts[0]) / (len(ts) - 1))
        outs += len(ts)
        finish = max(finish, ts[-1])
    return dict(max_concurrent=max(st["batch"] for st in steps), output_tokens=outs,
                wall_s=finish, output_tok_s=outs / finish,
                ttft_median_s=statistics.median(ttft), ttft_p99_s=pct(ttft, 99),
                tpot_median_s=statistics.median(tpot), tpot_p99_s=pct(tpot, 99),
                step_median_s=statistics.median(st["step_s"] for st in steps),
                # Where the wall time went: steps that prefilled a prompt (with the decodes
                # batched beside it) vs decode-only steps, and a decode step's batch.
                prefill_steps_s=sum(st["step_s"] for st in steps if st["prefill"]),
                decode_steps_s=sum(st["step_s"] for st in steps if not st["prefill"]),
                decode_step_median_s=statistics.median([st["step_s"] for st in steps if not st["prefill"]] or [0.0]),
                decode_batch_median=statistics.median([st["batch"] for st in steps if not st["prefill"]] or [0]),
                # Tokens/s of the decode-only steps (each request in one makes one token): the
                # rate a decode instance would run at this concurrency, with the prompts'
                # prefill done elsewhere (P/D); the trace's own rate above includes prefill.
                decode_tok_s=(sum(st["batch"] for st in steps if not st["prefill"])
                              / max(1e-9, sum(st["step_s"] for st in steps if not st["prefill"]))),
                steps=len(steps), kv_trace=[(round(st["t"], 4), round(st["kv_used"], 4), st["batch"])
                                            for st in steps])


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median of each figure over the runs, with [min, max]."""
    keys = [k for k, v in runs[0].items() if isinstance(v, (int, float))]
    out: dict[str, Any] = {}
    for k in keys:
        vals = [r[k] for r in runs]
        out[k] = statistics.median(vals)
        out[k + "_spread"] = [min(vals), max(vals)]
    med = sorted(runs, key=lambda r: r["output_tok_s"])[len(runs) // 2]
    out["kv_trace"] = med["kv_trace"]  # the median run's (by tokens/s), for the plot
    return out


def bench_llm(ckpt: str, tp: int, dcp: int, budget: int, spec: TraceSpec, vocab: int, runs: int,
              block_size: int, lowering: str) -> dict[str, Any]:
    from cp_compile import LLM, SamplingParams

    trace = make_trace(spec, vocab)
    t0 = time.perf_counter()
    with LLM(model=ckpt, tensor_parallel_size=tp, decode_context_parallel_size=dcp, block_size=block_size,
             max_model_len=spec.max_model_len, max_num_seqs=64, kv_cache_memory_bytes=budget,
             lowering=lowering) as llm:
        start_s = time.perf_counter() - t0
        pool = llm.executor.limits
        # Warm-up (untimed): one short request, so first-step costs are not in run 1.
        llm.generate([trace[0].prompt[:16]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                     use_tqdm=False)
        per_run = [run_trace(llm, trace) for _ in range(runs)]
    return pool_row(pool, tp=tp, dcp=dcp, budget=budget, max_model_len=spec.max_model_len, block_size=block_size,
                    start_s=start_s, per_run=per_run)


def pool_row(pool: Any, *, tp: int, dcp: int, budget: int, max_model_len: int, block_size: int, start_s: float,
             per_run: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """One table row: the pool's capacity (as the engine's start-up lines state it), the runs'
    medians with their spreads, and each run's figures (`bench_llm`'s and `bench_pd`'s)."""
    per_request_blocks = math.ceil(max_model_len / (block_size * dcp))
    row = dict(tp=tp, dcp=dcp, **extra, kv_cache_memory_bytes=budget, num_blocks=pool.num_blocks,
               tokens_per_rank=pool.num_blocks * block_size, tokens_per_group=pool.num_blocks * block_size * dcp,
               max_concurrency_at_max_model_len=pool.num_blocks // per_request_blocks, start_s=round(start_s, 2),
               runs=len(per_run), **summarize(per_run))
    row["per_run"] = [{k: v for k, v in r.items() if k != "kv_trace"} for r in per_run]
    return row


# ---- item 4: transformers' own generate ---------------------------------------------
def hf_cache_bytes_per_token(config: Any) -> int:
    """Bytes a token costs in HF's static cache (fp32): K and V per KV head per layer
    (DeepSeek-V3 in transformers caches the per-head K (nope + rope) and V, not the latent)."""
    if config.model_type == "qwen3":
        per_layer = 2 * config.num_key_value_heads * config.head_dim
    else:
        per_layer = config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim
                                                  + config.v_head_dim)
    return per_layer * config.num_hidden_layers * 4


def bench_hf(ckpt: str, budget: int, spec: TraceSpec, vocab: int, runs: int, compile_: bool) -> dict[str, Any]:
    """Static batches in arrival order, each as large as `budget` bytes of HF cache hold
    (at least 1: over budget then, said in the row); left-padded, greedy, static cache."""
    import torch
    import transformers

    trace = make_trace(spec, vocab)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    per_tok = hf_cache_bytes_per_token(model.config)
    fits = budget // (per_tok * spec.max_model_len)
    batch = max(1, fits)
    if compile_:
        model.forward = torch.compile(model.forward)
    batches = [trace[i:i + batch] for i in range(0, len(trace), batch)]

    def once() -> dict[str, float]:
        t0 = time.perf_counter()
        outs = 0
        for b in batches:
            wait = max(r.arrival for r in b) - (time.perf_counter() - t0)  # a batch starts when its last arrives
            if wait > 0:
                time.sleep(wait)
            width = max(len(r.prompt) for r in b)
            ids = torch.zeros(len(b), width, dtype=torch.long)
            mask = torch.zeros(len(b), width, dtype=torch.long)
            for j, r in enumerate(b):  # left padding
                ids[j, width - len(r.prompt):] = torch.tensor(r.prompt)
                mask[j, width - len(r.prompt):] = 1
            new = max(r.max_tokens for r in b)
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                               do_sample=False, cache_implementation="static", pad_token_id=0)
            outs += sum(r.max_tokens for r in b)  # useful tokens: each request's own max_tokens
        wall = time.perf_counter() - t0
        return dict(output_tokens=outs, wall_s=wall, output_tok_s=outs / wall)

    with torch.no_grad():  # warm-up (and the compile, with --hf-compile)
        model.generate(input_ids=torch.tensor([trace[0].prompt[:16]]), max_new_tokens=2, do_sample=False,
                       cache_implementation="static", pad_token_id=0)
    per_run = [once() for _ in range(runs)]
    out = dict(engine="transformers.generate", compiled=compile_, static_cache=True, batch=batch,
               requests_fit_in_budget=fits, cache_bytes_per_token=per_tok,
               cache_bytes=per_tok * spec.max_model_len * batch, kv_cache_memory_bytes=budget, runs=runs,
               torch_threads=torch.get_num_threads())
    for k in ("output_tok_s", "wall_s"):
        vals = [r[k] for r in per_run]
        out[k] = statistics.median(vals)
        out[k + "_spread"] = [min(vals), max(vals)]
    out["per_run"] = per_run
    return out


# ---- report -------------------------------------------------------------------------
def format_rows(result: dict[str, Any]) -> str:
    lines = [f"## {result['shape']}  (tp {result['tp']}, KV budget {result['kv_cache_memory_bytes']:,d} B per rank, "
             f"{result['trace']['requests']} requests)",
             "| engine | dcp | tokens/group | admitted at max_model_len | max concurrent | output tok/s | "
             "TTFT med / p99 (s) | TPOT med / p99 (ms) | decode-only steps: tok/s, batch med | prefill share |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def sp(r: dict[str, Any], k: str, f: str, scale: float = 1.0) -> str:
        lo, hi = r[k + "_spread"]
        return f"{r[k] * scale:{f}} [{lo * scale:{f}}-{hi * scale:{f}}]"

    for r in result["dcp"] + result.get("pd", []):
        lines.append(f"| {'LLM, decode instance (P/D)' if r.get('role') else 'LLM'} | {r['dcp']} | {r['tokens_per_group']:,d} | {r['max_concurrency_at_max_model_len']} | "
                     f"{sp(r, 'max_concurrent', '.0f')} | {sp(r, 'output_tok_s', '.1f')} | "
                     f"{r['ttft_median_s']:.2f} / {r['ttft_p99_s']:.2f} | "
                     f"{r['tpot_median_s'] * 1e3:.0f} / {r['tpot_p99_s'] * 1e3:.0f} | "
                     f"{sp(r, 'decode_tok_s', '.1f')}, {r['decode_batch_median']:.0f} | "
                     f"{r['prefill_steps_s'] / max(1e-9, r['prefill_steps_s'] + r['decode_steps_s']):.0%} |")
    if result.get("hf"):
        h = result["hf"]
        lines.append(f"| HF generate ({'compiled' if h['compiled'] else 'eager'}, static cache, batch {h['batch']}) "
                     f"| 1 | - | {h['requests_fit_in_budget']} | {h['batch']} | {sp(h, 'output_tok_s', '.1f')} | - | - | - | - |")
    for b in result.get("breakdown", []):
        for side in ("decode", "prefill"):
            d = b[side]
            lines.append(f"dcp {b['dcp']} {side} (batch {b['batch'] if side == 'decode' else 1}, context "
                         f"{b['context']}): step {d['step']:.1f} ms = attention {d['attention']:.1f} + dcp_local "
                         f"{d['dcp_local']:.1f} + dcp_comm {d['dcp_comm']:.1f} + tp_comm {d['tp_comm']:.1f} + other "
                         f"(GEMMs, norms, Python) {d['other']:.1f}")
    for label, group in (("colocated", result["dcp"]), ("decode instance (P/D)", result.get("pd", []))):
        for b in group[1:]:
            a = group[0]
            lines.append(f"{label}: dcp {b['dcp']} / dcp {a['dcp']}: max concurrent "
                         f"x{b['max_concurrent'] / a['max_concurrent']:.2f}, "
                         f"output tok/s x{b['output_tok_s'] / a['output_tok_s']:.2f}, "
                         f"decode-only tok/s x{b['decode_tok_s'] / max(1e-9, a['decode_tok_s']):.2f}, "
                         f"step median x{b['step_median_s'] / a['step_median_s']:.2f}")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 6), squeeze=False, sharex="col")
    for col, res in enumerate(results):
        for r in res["dcp"] + res.get("pd", []):
            t = [p[0] for p in r["kv_trace"]]
            label = f"dcp {r['dcp']}" + (" (D of P/D)" if r.get("role") else "")
            axes[0][col].step(t, [100 * p[1] for p in r["kv_trace"]], where="post", label=label)
            axes[1][col].step(t, [p[2] for p in r["kv_trace"]], where="post", label=label)
        axes[0][col].set_title(f"{res['shape']}, tp {res['tp']}: KV budget {res['kv_cache_memory_bytes'] / 2**20:.1f} MiB/rank")
        axes[0][col].set_ylabel("KV blocks reserved (%)")
        axes[1][col].set_ylabel("requests in the step")
        axes[1][col].set_xlabel("time since first arrival (s)")
        axes[0][col].legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# ---- main ---------------------------------------------------------------------------
def parse(argv: Seq[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3,mla", help="comma list of " + ", ".join(SCALED))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--dcp", default="1,2")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--prompt", default="256,1024", help="min,max prompt tokens (issue: 16k-64k; here / 64)")
    p.add_argument("--output", default="8,32", help="min,max output tokens (issue: 64-256; here / 8)")
    p.add_argument("--interval", type=float, default=0.25, help="seconds between arrivals")
    p.add_argument("--budget-requests", type=int, default=2,
                   help="KV budget per rank = this many requests of max_model_len at dcp 1")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--lowering", default="eager")
    p.add_argument("--breakdown", action="store_true", help="profile one decode / prefill step per dcp")
    p.add_argument("--hf", action="store_true", help="also transformers' generate (item 4)")
    p.add_argument("--hf-compile", action="store_true")
    p.add_argument("--pd", action="store_true", help="also the decode instance of a P/D split: the prompts "
                   "prefilled by a producer LLM, imported over NIXL (examples/bench/payoff_pd.py)")
    p.add_argument("--no-colocated", action="store_true", help="with --pd: only the decode-instance rows")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--out", default="bench_dcp_payoff.json")
    p.add_argument("--plot", default=None)
    p.add_argument("--merge", default=None, help="comma list of JSON files this script wrote: print and plot them "
                   "together (shapes run as separate processes), nothing is run")
    return p.parse_args(argv)


def main(argv: Seq[str] | None = None) -> list[dict[str, Any]]:
    from cp_compile.serving.entrypoints.executors import EngineArgs
    from cp_compile.serving.hf.kv_budget import bytes_per_block

    args = parse(argv)
    if args.merge:
        results = [r for f in args.merge.split(",") for r in json.load(open(f))]
        for res in results:
            print(format_rows(res) + "\n", flush=True)
        return _save(results, args)
    lo, hi = map(int, args.prompt.split(","))
    olo, ohi = map(int, args.output.split(","))
    spec = TraceSpec(args.requests, lo, hi, olo, ohi, args.interval)
    ckpt_root = args.ckpt_dir or tempfile.mkdtemp(prefix="payoff_")
    results = []
    for name in args.shape.split(","):
        shape = SCALED[name]
        ckpt = write_checkpoint(shape, args.tp, os.path.join(ckpt_root, f"{name}_tp{args.tp}"))
        import transformers

        hf_config = transformers.AutoConfig.from_pretrained(ckpt)
        ea = EngineArgs(model=ckpt, tensor_parallel_size=args.tp, block_size=args.block_size)
        block_bytes = bytes_per_block(ea.cp_config(), hf_config, ea.torch_dtype(hf_config))
        budget = args.budget_requests * math.ceil(spec.max_model_len / args.block_size) * block_bytes
        print(f"[{name}] block {block_bytes:,d} B, budget {budget:,d} B per rank", file=sys.stderr, flush=True)
        res: dict[str, Any] = dict(shape=shape.name, source=shape.source, scaled=asdict(shape), tp=args.tp,
                                   kv_cache_memory_bytes=budget, block_bytes=block_bytes, lowering=args.lowering,
                                   trace=asdict(spec), dcp=[])
        dcps = list(map(int, args.dcp.split(",")))
        for dcp in dcps if not args.no_colocated else []:
            t0 = time.perf_counter()
            res["dcp"].append(bench_llm(ckpt, args.tp, dcp, budget, spec, hf_config.vocab_size, args.runs,
                                        args.block_size, args.lowering))
            print(f"[{name}] dcp {dcp}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if args.pd:
            from examples.bench.payoff_pd import bench_pd

            t0 = time.perf_counter()
            res["pd"] = bench_pd(ckpt, args.tp, dcps, budget, block_bytes, spec, hf_config.vocab_size, args.runs,
                                 args.block_size, args.lowering, make_trace, run_trace, pool_row)
            print(f"[{name}] P/D: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        if args.breakdown:  # per-step time split at each dcp's admitted batch (examples/bench/payoff_breakdown.py)
            from examples.bench.payoff_breakdown import step_breakdown

            res["breakdown"] = [step_breakdown(ckpt, args.tp, r["dcp"], budget, args.block_size, spec.max_model_len,
                                               args.lowering, (lo + hi) // 2)
                                for r in res["dcp"]]
        if args.hf:
            res["hf"] = bench_hf(ckpt, budget, spec, hf_config.vocab_size, args.runs, args.hf_compile)
        results.append(res)
        print(format_rows(res) + "\n", flush=True)
    return _save(results, args)


def _save(results: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The JSON (`--out`) and, with `--plot`, the KV-use plot."""
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    if args.plot:
        print(f"wrote {plot(results, args.plot)}", flush=True)
    return results


if __name__ == "__main__":
    main()
