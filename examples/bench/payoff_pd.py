"""The DCP payoff on a decode instance: P/D disaggregation, the prompts prefilled elsewhere.

DCP is a decode-side layout (vLLM serves it on the decode instances of a P/D split): the
prefill instance (P) computes each prompt's KV, the decode instance (D) imports it over
the KV connector (NIXL, UCX over DRAM here) and decodes. On 2 CPU cores a colocated
long-prompt trace is prefill-bound and DCP cannot change a rank's prefill FLOPs
(docs/benchmarks.md), so the colocated figure says nothing of what DCP does to decode.
This measures it where it is deployed.

One producer `LLM` (tp, dcp 1, a pool that holds every request of a run) serves every
consumer configuration. Per run: P prefills the trace's prompts (`max_tokens=1`,
untimed: P's seconds are reported beside), then the trace runs through the consumer
`LLM` (tp, dcp d, the benchmark's KV budget per rank) with its wall-clock arrivals and
each request's `kv_transfer_params`: admitted when its blocks fit, imported (the reads
are in D's step time), decoded with continuous batching. D's figures are the colocated
trace's (`run_trace`): output tokens/s, TTFT (arrival -> the imported first token) and
TPOT, the most requests one step ran. A producer export is read once, so each run
prefills again.
"""

from __future__ import annotations

import math
import socket
import time
from typing import Any, Callable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_configs(port: int, tag: str) -> tuple[dict, dict]:
    """The producer's and the consumer's `kv_transfer_config` (the producer hosts the store)."""
    extra = {"transfer_timeout_s": 120.0, "handoff_timeout_s": 1800.0}
    p = {"kv_role": "kv_producer", "engine_id": f"prefill-{tag}", "kv_port": port,
         "kv_connector_extra_config": {**extra, "store_master": True}}
    d = {"kv_role": "kv_consumer", "engine_id": f"decode-{tag}", "kv_port": port,
         "kv_connector_extra_config": {**extra, "remote_engine_id": f"prefill-{tag}"}}
    return p, d


def bench_pd(ckpt: str, tp: int, dcps: list[int], budget: int, block_bytes: int, spec: Any, vocab: int, runs: int,
             block_size: int, lowering: str, make_trace: Callable, run_trace: Callable,
             summarize: Callable) -> list[dict[str, Any]]:
    """One row per dcp in `dcps` (the decode instance's), the same shape as `bench_llm`'s."""
    from cp_compile import LLM, SamplingParams

    trace = make_trace(spec, vocab)
    # P holds a run's exports until D has read them: every request at max_model_len, twice
    # (the previous run's are freed by P's next step).
    p_blocks = 2 * len(trace) * math.ceil(spec.max_model_len / block_size)
    port = _free_port()
    p_kv, _ = kv_configs(port, "payoff")
    rows = []
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with LLM(model=ckpt, tensor_parallel_size=tp, block_size=block_size, max_model_len=spec.max_model_len,
             max_num_seqs=64, kv_cache_memory_bytes=p_blocks * block_bytes, lowering=lowering,
             kv_transfer_config=p_kv) as p:
        for dcp in dcps:
            _, d_kv = kv_configs(port, "payoff")
            d_kv["engine_id"] = f"decode-dcp{dcp}"
            t0 = time.perf_counter()
            with LLM(model=ckpt, tensor_parallel_size=tp, decode_context_parallel_size=dcp, block_size=block_size,
                     max_model_len=spec.max_model_len, max_num_seqs=64, kv_cache_memory_bytes=budget,
                     lowering=lowering, kv_transfer_config=d_kv) as d:
                start_s = time.perf_counter() - t0
                pool = d.executor.limits
                # Warm-up (untimed): one short request through both instances.
                warm = p.generate([trace[0].prompt[:16]], first, use_tqdm=False)
                d.generate([trace[0].prompt[:16]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                           use_tqdm=False, kv_transfer_params=[warm[0].kv_transfer_params])
                per_run, prefill_s = [], []
                for _ in range(runs):
                    t1 = time.perf_counter()
                    pre = p.generate([r.prompt for r in trace], first, use_tqdm=False)
                    prefill_s.append(time.perf_counter() - t1)
                    per_run.append(run_trace(d, trace, kv_params=[o.kv_transfer_params for o in pre]))
            per_request_blocks = math.ceil(spec.max_model_len / (block_size * dcp))
            row = dict(tp=tp, dcp=dcp, role="decode instance (P/D)", kv_cache_memory_bytes=budget,
                       num_blocks=pool.num_blocks, tokens_per_rank=pool.num_blocks * block_size,
                       tokens_per_group=pool.num_blocks * block_size * dcp,
                       max_concurrency_at_max_model_len=pool.num_blocks // per_request_blocks,
                       start_s=round(start_s, 2), runs=runs, producer_prefill_s=prefill_s, **summarize(per_run))
            row["per_run"] = [{k: v for k, v in r.items() if k != "kv_trace"} for r in per_run]
            rows.append(row)
    return rows
