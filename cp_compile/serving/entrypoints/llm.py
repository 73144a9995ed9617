"""`cp_compile.LLM`: the seeds' offline API over a local checkpoint directory.

    from cp_compile import LLM, SamplingParams
    llm = LLM(model="/path/to/ckpt", tensor_parallel_size=2, decode_context_parallel_size=2,
              prefill_context_parallel_size=2)
    outputs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))
    print(outputs[0].outputs[0].text)

The directory is what `save_pretrained` writes (config.json, safetensors, the
tokenizer files); the model runs through `cp_compile.serving.hf.Engine` (no model code of
ours). Ranks: world 1 runs in this process; a larger world spawns CPU gloo worker
processes (`executors.SpawnedExecutor`) and tears them down on `close()` / exit.
Under torchrun (RANK / WORLD_SIZE set) this process is one rank: every rank runs the
script, its own engine and driver on the same requests, and rank 0's sampled tokens
are broadcast to the others each step (one sampler). Outputs are shaped like vLLM's `RequestOutput`.
`lowering` defaults to $CP_COMPILE_LOWERING, else "auto" (Inductor on CPU).
"""

from __future__ import annotations

import atexit
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence as Seq

from cp_compile.base.config import ConfigError
from cp_compile.serving.entrypoints.driver import Driver
from cp_compile.serving.entrypoints.executors import EngineArgs, LocalExecutor, SpawnedExecutor, build_engine
from cp_compile.serving.entrypoints.kv_driver import ProducerSide, make_side, rank_config
from cp_compile.serving.kv_transfer import KVTransferConfig
from cp_compile.serving.loop.scheduler import Sequence
from cp_compile.runtime.parallel_state import destroy_parallel
from cp_compile.base.sampling import Logprob, RequestError, SamplingParams, is_list_like


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # set when SamplingParams.logprobs is not None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: sampled + top-`logprobs` (vLLM's shape)
    finish_reason: str | None = None  # "stop" (EOS, stop token or string), "length", "abort"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    kv_transfer_params: dict | None = None  # kv_producer: pass to the kv_consumer's generate (kv_driver.py)


class TextState:
    """Incremental detokenisation and stop strings for one request."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""
        self.stop_reason: str | None = None

    def update(self, output_ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        text = self.tokenizer.decode(output_ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                self.text, self.stop_reason = text[:at], s
                return "stop"
        self.text = text
        return None


def load_tokenizer(path: str) -> Any:
    """The checkpoint's own tokenizer, or None when the directory has none (token ids only)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path)


class LLM:
    """Offline generation (vLLM's `LLM` names; see module doc)."""

    def __init__(self, model: str, tensor_parallel_size: int = 1, decode_context_parallel_size: int = 1,
                 prefill_context_parallel_size: int = 1, cp_kv_cache_interleave_size: int = 1, block_size: int = 16,
                 dtype: str = "auto", max_model_len: int | None = None, enable_dsa_cp: bool = False,
                 max_num_seqs: int = 8, num_kv_blocks: int | None = None, kv_cache_memory_bytes: int | None = None,
                 kv_cache_dtype: str = "auto", seed: int = 0, lowering: str | None = None,
                 tokenizer: str | None = None, kv_transfer_config: dict | None = None, step_timeout_s: float = 300.0,
                 **unsupported: Any) -> None:
        if unsupported:
            raise TypeError(f"LLM: unsupported arguments {sorted(unsupported)}; cp_compile.LLM takes model, "
                            "tensor_parallel_size, decode_context_parallel_size, prefill_context_parallel_size, "
                            "cp_kv_cache_interleave_size, block_size, dtype, max_model_len, enable_dsa_cp, "
                            "max_num_seqs, num_kv_blocks, kv_cache_memory_bytes, kv_cache_dtype, seed, lowering, "
                            "tokenizer, kv_transfer_config, step_timeout_s")
        kv = KVTransferConfig.from_dict(kv_transfer_config) if kv_transfer_config is not None else None
        if kv is not None and "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("kv_transfer_config with spawned ranks (one driver per instance)",
                              f"launched by torchrun (WORLD_SIZE={os.environ['WORLD_SIZE']})",
                              "run the PD instance as a plain process: LLM spawns its ranks itself")
        if not os.path.isdir(model):
            raise ValueError(f"model={model!r}: not a local directory. Fix: pass the directory save_pretrained "
                             "wrote (config.json + *.safetensors); nothing is downloaded")
        self.args = EngineArgs(model=model, tensor_parallel_size=tensor_parallel_size,
                               decode_context_parallel_size=decode_context_parallel_size,
                               prefill_context_parallel_size=prefill_context_parallel_size,
                               cp_kv_cache_interleave_size=cp_kv_cache_interleave_size, block_size=block_size,
                               dtype=dtype, max_model_len=max_model_len, enable_dsa_cp=enable_dsa_cp,
                               max_num_seqs=max_num_seqs, num_kv_blocks=num_kv_blocks,
                               kv_cache_memory_bytes=kv_cache_memory_bytes, kv_cache_dtype=kv_cache_dtype,
                               lowering=lowering or os.environ.get("CP_COMPILE_LOWERING", "auto"),
                               kv_transfer_config=rank_config(kv) if kv is not None else None,
                               step_timeout_s=step_timeout_s)
        self.args.validate()  # an unservable model or bad sizes fail here, before any process starts
        kv_side = make_side(kv)  # a producer hosting the store starts it before its ranks connect
        self.tokenizer = load_tokenizer(tokenizer or model)
        share = False
        if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # Launched by torchrun: this process is one rank; every rank runs this script
            # (SPMD), rank 0's sampled tokens are broadcast to the others (cp_compile.base.sampling.share).
            world = int(os.environ["WORLD_SIZE"])
            if world != self.args.world_size:
                raise ConfigError("torchrun world == tensor_parallel_size * prefill_context_parallel_size",
                                  f"WORLD_SIZE={world}, tensor_parallel_size={tensor_parallel_size}, "
                                  f"prefill_context_parallel_size={prefill_context_parallel_size}",
                                  f"launch with --nproc-per-node {self.args.world_size}")
            self.executor: Any = LocalExecutor(build_engine(self.args))
            share = True
        elif self.args.world_size == 1 and decode_context_parallel_size == 1:
            self.executor = LocalExecutor(build_engine(self.args))
        else:
            self.executor = SpawnedExecutor(self.args)
        self.driver = Driver(self.executor, self.executor.limits, seed=seed, share_tokens=share, kv_side=kv_side)
        self._closed = False
        self._count = 0
        atexit.register(self.close)

    @property
    def kv_capacity(self) -> list[dict[str, int]]:
        """Per rank: tokens stored, tokens per context-parallel group, KV bytes, and the bytes at dcp = pcp = 1."""
        return self.executor.capacity

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {prompt[:20]!r}: the model directory has no tokenizer. Fix: pass token "
                                 "ids, or save a tokenizer into the directory")
            return list(self.tokenizer(prompt)["input_ids"])
        if not is_list_like(prompt):
            raise RequestError("prompt", prompt, "", f"{prompt!r} is neither text nor a list of token ids. Fix: pass "
                               "a string or a list of ints")
        return list(prompt)

    @property
    def kv_blocks(self) -> list[dict[str, Any]]:
        """Per rank: free KV blocks, the total, and the requests a failed transfer quarantined
        (PD disaggregation, kv_rank.py)."""
        return self.executor.call("kv_blocks", None)

    def submit(self, prompt: str | list[int], params: SamplingParams,
               on_update: Callable[[Sequence, TextState], None] | None = None,
               kv_transfer_params: dict | None = None) -> tuple[Sequence, TextState]:
        """Add one request to the running batch (the server's entry); raises RequestError."""
        ids = self.encode(prompt)
        text = TextState(self.tokenizer, list(params.stop or []))

        def on_token(seq: Sequence) -> str | None:
            reason = text.update(seq.output)
            if on_update is not None:
                on_update(seq, text)
            return reason

        seq = self.driver.add(ids, params, on_token, kv_transfer_params)
        return seq, text

    def generate(self, prompts: str | Seq[str] | Seq[list[int]], sampling_params: SamplingParams | Seq[SamplingParams]
                 | None = None, use_tqdm: bool = True, kv_transfer_params: Seq[dict | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids) with continuous batching;
        every request is checked before any runs. `kv_transfer_params` (a kv_consumer
        instance): per prompt, the producer's `RequestOutput.kv_transfer_params` (its KV
        is imported, decoding starts after the prompt) or None (prefilled here)."""
        if not isinstance(prompts, str) and not is_list_like(prompts):
            raise RequestError("prompts", prompts, "", f"prompts={prompts!r} is not a prompt or a list of them. Fix: "
                               "a string, a list of token ids, or a list of those")
        if isinstance(prompts, str) or (len(prompts) and not isinstance(prompts[0], str)
                                        and not is_list_like(prompts[0])):
            prompts = [prompts]  # type: ignore[list-item]  # one prompt of token ids (each checked below)
        params = sampling_params if sampling_params is not None else SamplingParams()
        plist = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(plist)} sampling_params for {len(prompts)} prompts; give one or one per prompt")
        for i, sp in enumerate(plist):
            if not isinstance(sp, SamplingParams):
                raise RequestError("sampling_params", sp, "", f"sampling_params[{i}]={sp!r} is not a SamplingParams. "
                                   "Fix: pass cp_compile.SamplingParams(...), one or one per prompt")
        kvp = list(kv_transfer_params) if kv_transfer_params is not None else [None] * len(prompts)
        if len(kvp) != len(prompts):
            raise ValueError(f"{len(kvp)} kv_transfer_params for {len(prompts)} prompts; give one (or None) per prompt")
        encoded = []
        for i, (p, sp, kp) in enumerate(zip(prompts, plist, kvp)):
            try:
                ids = self.encode(p)
                self.driver.check(ids, sp, kp)
            except ValueError as e:
                e.args = (f"prompt {i}: {e}",)
                raise
            encoded.append(ids)
        # n samples of a prompt are n requests (sample i seeded seed + i), batched together.
        groups = [[self.submit(ids, sp.for_sample(i), kv_transfer_params=kp) for i in range(sp.n)]
                  for ids, sp, kp in zip(encoded, plist, kvp)]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(groups), desc="Processed prompts", unit="req")
        done = 0

        def progress(_: list[Sequence]) -> None:
            nonlocal done
            now = sum(all(s.finish_reason is not None for s, _ in g) for g in groups)
            if bar is not None:
                bar.update(now - done)
            done = now

        try:
            self.driver.run_until_done(progress)
        except BaseException:  # a failed KV import (or a rank): drop this call's requests, free their blocks
            if bar is not None:
                bar.close()
            try:
                self.driver.drop([s for g in groups for s, _ in g])
            except Exception:  # noqa: BLE001 - a lost rank: the original error is the one to see
                pass
            raise
        if bar is not None:
            bar.close()
        outs = []
        for group, prompt in zip(groups, prompts):
            self._count += 1
            outs.append(RequestOutput(
                request_id=str(self._count - 1), prompt=prompt if isinstance(prompt, str) else None,
                prompt_token_ids=list(group[0][0].prompt), finished=True,
                outputs=[self.completion(i, seq, text) for i, (seq, text) in enumerate(group)],
                kv_transfer_params=group[0][0].payload.kv_transfer_params))
        return outs

    def completion(self, index: int, seq: Sequence, text: TextState) -> CompletionOutput:
        """One finished (or running) request as vLLM's CompletionOutput."""
        stop_reason = text.stop_reason if text.stop_reason is not None else (
            seq.output[-1] if seq.finish_reason == "stop" and seq.output else None)
        st = seq.payload
        logprobs = cumulative = None
        if st.params.logprobs is not None:
            logprobs = [{t: Logprob(lp.logprob, lp.rank, self.decode_token(t)) for t, lp in pos.items()}
                        for pos in st.logprobs]
            cumulative = st.cumulative_logprob
        return CompletionOutput(index, text.text, list(seq.output), cumulative, logprobs, seq.finish_reason,
                                stop_reason)

    def decode_token(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def close(self) -> None:
        """Tear the ranks down (also at exit)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        if isinstance(self.driver.kv_side, ProducerSide):
            self.driver.kv_side.close(self.driver.scheduler)  # the consumer may still read held requests
        self.executor.close()
        if self.driver.share_tokens:  # this process is a torchrun rank: its own parallel state
            destroy_parallel()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
