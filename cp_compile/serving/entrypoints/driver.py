"""The driver: one process owns the scheduler and the sampler; the ranks execute plans.

    driver = Driver(executor, limits)
    seq = driver.add(prompt_ids, SamplingParams(temperature=0.8, seed=0))
    while driver.has_work():
        driver.step()            # one plan to every rank, rank 0's last logits back, one token each

Shared by the offline `LLM` and the server, so both produce the same tokens for the
same requests. The loop itself is `cp_compile.serving.loop.step_loop.StepLoop` (also under
`hf.Engine.generate`); the driver adds the request checks, request ids, and the
PD-disaggregation hooks. Sampling happens in the loop only
(`cp_compile.base.sampling.Sampler`): every rank gets the chosen tokens in the next plan,
so ranks cannot disagree.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from cp_compile.serving.entrypoints.kv_driver import ProducerSide
from cp_compile.serving.loop import step_loop
from cp_compile.serving.loop.scheduler import Scheduler, Sequence, StepPlan
from cp_compile.serving.loop.step_loop import StepLoop
from cp_compile.base.sampling import RequestError, SamplingParams, token_ids


class Executor(step_loop.Executor, Protocol):
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
class RequestState(step_loop.RequestState):
    """The driver's per-request state (Sequence.payload): the loop's, and PD disaggregation's."""

    kv_import: Any = None  # consumer: the request's KV comes from the producer (kv_driver.Imported)
    kv_transfer_params: dict | None = None  # producer: what the consumer needs to import it (kv_driver)


class Driver(StepLoop):
    def __init__(self, executor: Executor, limits: Limits, seed: int = 0, share_tokens: bool = False,
                 kv_side: Any = None) -> None:
        # kv_side: PD disaggregation (kv_driver.ProducerSide / ConsumerSide), else None.
        self.kv_side = kv_side
        # share_tokens: this process is one torchrun rank (StepLoop: rank 0's tokens for all).
        super().__init__(executor, Scheduler(limits.num_blocks, limits.virtual_block_size, limits.max_batch),
                         share=share_tokens)
        self.limits = limits
        self._fallback = torch.Generator().manual_seed(seed)
        self._ids = itertools.count()

    def check(self, prompt: list[int], params: SamplingParams, kv_transfer_params: Any = None) -> int:
        """Refuse a request before it joins (RequestError naming the field); returns
        its max_tokens (vLLM's default: what is left of max_model_len)."""
        if self.kv_side is not None:
            self.kv_side.check(len(prompt), params, kv_transfer_params)
        elif kv_transfer_params is not None:
            raise RequestError("kv_transfer_params", "given", "this instance has no kv_transfer_config. Fix: send "
                               "the request to a kv_consumer instance, or drop kv_transfer_params")
        lim = self.limits
        if not isinstance(params, SamplingParams):
            raise RequestError("sampling_params", params, "is not a SamplingParams. Fix: pass "
                               "cp_compile.SamplingParams(...)")
        params.validate(lim.vocab_size)
        token_ids(prompt, lim.vocab_size)  # RequestError("prompt") naming the position and the value
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
        prompt = token_ids(prompt, self.limits.vocab_size)  # plain ints (numpy / tensor ints converted)
        eos = frozenset(() if params.ignore_eos else self.limits.eos_token_ids) | frozenset(params.stop_token_ids)
        state = RequestState(params, self.sampler.generator_for(params, self._fallback), on_token)
        if self.kv_side is not None and kv_transfer_params is not None:
            state.kv_import = self.kv_side.check(len(prompt), params, kv_transfer_params)
        return self.submit(Sequence(next(self._ids), list(prompt), max_tokens, eos, payload=state))

    def abort(self, seq: Sequence) -> None:
        """Drop a request (a client went away); its KV blocks are freed by the next step."""
        self.scheduler.abort(seq.rid)

    # ---- StepLoop hooks: PD disaggregation ------------------------------------------
    def _producer(self) -> bool:
        return isinstance(self.kv_side, ProducerSide)

    def _before_plan(self) -> None:
        if self._producer() and self.kv_side.held:
            self.kv_side.release_consumed(self.scheduler)

    def _idle(self) -> None:
        if self._producer():
            self.kv_side.idle(self.scheduler)

    def _admitted(self, plan: StepPlan) -> StepPlan:
        if self.kv_side is not None and not self._producer():
            return self.kv_side.import_admitted(self.executor, self.scheduler, plan)  # KVTransferError: failed requests
        return plan

    def _after_commit(self, running: list[Sequence]) -> None:
        if self._producer():
            self.kv_side.after_commit(self.executor, self.scheduler, [s for s in running if s.finish_reason is not None])
