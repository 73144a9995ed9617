"""The driver: one process owns the scheduler and the sampler; the ranks execute plans.

    driver = Driver(executor, limits)
    seq = driver.add(prompt_ids, SamplingParams(temperature=0.8, seed=0))
    while driver.has_work():
        driver.step()            # one plan to every rank, rank 0's last logits back, one token each

Shared by the offline `LLM` and the server, so both produce the same tokens for the
same requests. Sampling happens here only (`cp_compile.base.sampling.Sampler`): every
rank gets the chosen tokens in the next plan, so ranks cannot disagree.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from cp_compile.serving.entrypoints.kv_driver import ProducerSide
from cp_compile.serving.hf.scheduler import Scheduler, Sequence, StepPlan
from cp_compile.base.sampling import Logprob, RequestError, Sampler, SamplingParams, token_logprobs


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> list[torch.Tensor]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Limits:
    """What the engine on the ranks can hold (from its `describe()`)."""

    num_blocks: int
    virtual_block_size: int
    max_batch: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


@dataclass
class RequestState:
    """The driver's per-request state (Sequence.payload)."""

    params: SamplingParams
    generator: torch.Generator | None
    on_token: Callable[[Sequence], str | None] | None  # -> a finish reason to stop early (stop strings)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # per output token, when params.logprobs
    cumulative_logprob: float = 0.0
    kv_import: Any = None  # consumer: the request's KV comes from the producer (kv_driver.Imported)
    kv_transfer_params: dict | None = None  # producer: what the consumer needs to import it (kv_driver)


class Driver:
    def __init__(self, executor: Executor, limits: Limits, seed: int = 0,
                 share_tokens: Callable[[list[int]], list[int]] | None = None, kv_side: Any = None) -> None:
        # kv_side: PD disaggregation (kv_driver.ProducerSide / ConsumerSide), else None.
        self.kv_side = kv_side
        # share_tokens: under torchrun every rank runs a driver on the same requests
        # (SPMD); rank 0's sampled tokens replace everyone's (a broadcast), so the
        # ranks still follow one sampler.
        self.share_tokens = share_tokens
        self.executor = executor
        self.limits = limits
        self.scheduler = Scheduler(limits.num_blocks, limits.virtual_block_size, limits.max_batch)
        self.sampler = Sampler()
        self._fallback = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()
        self.steps = 0

    def check(self, prompt: list[int], params: SamplingParams, kv_transfer_params: Any = None) -> int:
        """Refuse a request before it joins (RequestError naming the field); returns
        its max_tokens (vLLM's default: what is left of max_model_len)."""
        if self.kv_side is not None:
            self.kv_side.check(len(prompt), params, kv_transfer_params)
        elif kv_transfer_params is not None:
            raise RequestError("kv_transfer_params", "given", "this instance has no kv_transfer_config. Fix: send "
                               "the request to a kv_consumer instance, or drop kv_transfer_params")
        lim = self.limits
        params.validate(lim.vocab_size)
        if not prompt:
            raise RequestError("prompt", prompt, "is empty; give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < lim.vocab_size]
        if bad:
            raise RequestError("prompt", bad[:4], f"token ids must be integers in [0, {lim.vocab_size})")
        n = len(prompt)
        if n >= lim.max_model_len:
            raise RequestError("prompt", f"{n} tokens", f"longer than max_model_len={lim.max_model_len} - 1 (the "
                               "model's limit per request, prompt + output). Fix: a shorter prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else lim.max_model_len - n
        if n + max_tokens > lim.max_model_len:
            raise RequestError("max_tokens", max_tokens, f"{n} prompt tokens + max_tokens={max_tokens} exceed "
                               f"max_model_len={lim.max_model_len}. Fix: max_tokens <= {lim.max_model_len - n}")
        cap = self.scheduler.num_blocks * lim.virtual_block_size  # tokens one request can hold at most
        if n + max_tokens > cap:
            which = "prompt" if n > cap else "max_tokens"
            raise RequestError(which, n if which == "prompt" else max_tokens,
                               f"{n} prompt tokens + max_tokens={max_tokens} exceed the KV cache's capacity of "
                               f"{cap} tokens per request ({self.scheduler.num_blocks} blocks of "
                               f"{lim.virtual_block_size}). Fix: fewer tokens, or more KV blocks / a larger dcp")
        return max_tokens

    def add(self, prompt: list[int], params: SamplingParams,
            on_token: Callable[[Sequence], str | None] | None = None, kv_transfer_params: Any = None) -> Sequence:
        max_tokens = self.check(prompt, params, kv_transfer_params)
        eos = frozenset(() if params.ignore_eos else self.limits.eos_token_ids) | frozenset(params.stop_token_ids)
        state = RequestState(params, self.sampler.generator_for(params, self._fallback), on_token)
        if self.kv_side is not None and kv_transfer_params is not None:
            state.kv_import = self.kv_side.check(len(prompt), params, kv_transfer_params)
        seq = Sequence(next(self._ids), list(prompt), max_tokens, eos, payload=state)
        self.scheduler.add(seq)
        return seq

    def abort(self, seq: Sequence) -> None:
        """Drop a request (a client went away); its KV blocks are freed by the next step."""
        self.scheduler.abort(seq.rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.scheduler._free)

    def drop(self, seqs: list[Sequence]) -> None:
        """Drop these requests (after an error: a failed KV import) and free what left, now."""
        for s in seqs:
            if s.finish_reason is None:
                self.scheduler.abort(s.rid)
        self.executor.execute(StepPlan([], self.scheduler.drain_free()))

    def step(self) -> list[Sequence]:
        """One step on every rank; returns the requests that got a token (or finished)."""
        kv = self.kv_side
        producer = isinstance(kv, ProducerSide)
        if producer and kv.held:
            kv.release_consumed(self.scheduler)
        plan = self.scheduler.plan()
        if plan is None:
            if producer:
                kv.idle(self.scheduler)
            return []
        if kv is not None and not producer:
            plan = kv.import_admitted(self.executor, self.scheduler, plan)  # KVTransferError: failed requests
        running = list(self.scheduler.running)
        last = self.executor.execute(plan)
        self.steps += 1
        if not running:
            return []
        tokens = [self.sampler.sample(lg, s.payload.params, s.payload.generator) for s, lg in zip(running, last)]
        if self.share_tokens is not None:
            tokens = self.share_tokens(tokens)
        for s, lg, tok in zip(running, last, tokens):
            st: RequestState = s.payload
            if st.params.logprobs is not None:
                entry = token_logprobs(lg, tok, st.params.logprobs)
                st.logprobs.append(entry)
                st.cumulative_logprob += entry[tok].logprob
        self.scheduler.commit(tokens)
        for seq in running:
            cb = seq.payload.on_token
            if cb is not None:  # also for a request that just finished: its last token's text
                reason = cb(seq)
                if reason is not None and seq.finish_reason is None:
                    self.scheduler.finish(seq, reason)
        if producer:
            kv.after_commit(self.executor, self.scheduler, [s for s in running if s.finish_reason is not None])
        return running

    def run_until_done(self, progress: Any = None) -> None:
        while self.has_work():
            updated = self.step()
            if progress is not None:
                progress(updated)
