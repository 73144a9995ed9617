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
import time
from typing import Any, Callable

from cp_compile.serving.entrypoints.executors import free_port


_TIMEOUTS = {"transfer_timeout_s": 120.0, "handoff_timeout_s": 1800.0}


def producer_config(port: int, engine_id: str) -> dict:
    """The producer's `kv_transfer_config` (it hosts the store every consumer meets at `port`)."""
    return {"kv_role": "kv_producer", "engine_id": engine_id, "kv_port": port,
            "kv_connector_extra_config": {**_TIMEOUTS, "store_master": True}}


def consumer_config(port: int, producer: str, engine_id: str) -> dict:
    """A consumer's `kv_transfer_config`: its own engine id, reading from `producer`."""
    return {"kv_role": "kv_consumer", "engine_id": engine_id, "kv_port": port,
            "kv_connector_extra_config": {**_TIMEOUTS, "remote_engine_id": producer}}


def bench_pd(ckpt: str, tp: int, dcps: list[int], budget: int, block_bytes: int, spec: Any, vocab: int, runs: int,
             block_size: int, lowering: str, make_trace: Callable, run_trace: Callable,
             pool_row: Callable) -> list[dict[str, Any]]:
    """One row per dcp in `dcps` (the decode instance's), the same shape as `bench_llm`'s."""
    from cp_compile import LLM, SamplingParams

    trace = make_trace(spec, vocab)
    # P holds a run's exports until D has read them: every request at max_model_len, twice
    # (the previous run's are freed by P's next step).
    p_blocks = 2 * len(trace) * math.ceil(spec.max_model_len / block_size)
    port = free_port()
    p_kv = producer_config(port, "prefill-payoff")
    rows = []
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # P prefills two prompts a step: a whole trace of 16k-32k prompts in one step outran the
    # step bound (step_timeout_s, 300 s) on 2 cores, and its activations took 5.7 GB per rank.
    with LLM(model=ckpt, tensor_parallel_size=tp, block_size=block_size, max_model_len=spec.max_model_len,
             max_num_seqs=2, kv_cache_memory_bytes=p_blocks * block_bytes, lowering=lowering,
             kv_transfer_config=p_kv) as p:
        for dcp in dcps:
            d_kv = consumer_config(port, "prefill-payoff", f"decode-dcp{dcp}")
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
            rows.append(pool_row(pool, tp=tp, dcp=dcp, budget=budget, max_model_len=spec.max_model_len,
                                 block_size=block_size, start_s=start_s, per_run=per_run,
                                 role="decode instance (P/D)", producer_prefill_s=prefill_s))
    return rows
