"""Sampling: `SamplingParams` (vLLM's names) and the one sampler every front end uses.

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=0)
    tok = Sampler().sample(last_logits, params, generator)     # last_logits [vocab]

Filtering is HF's logits processors, in HF's order: temperature (logits / t), then
top-k (keep logits >= the k-th largest: ties at the cut stay), then top-p (sort
ascending, drop the tokens whose cumulative probability is <= 1 - top_p, always keep
the most likely one). `filter_logits` returns the filtered logits (-inf where
dropped), so a test can compare it with `transformers`' warpers on the same logits.

temperature == 0 is greedy: `int(logits.argmax())`, the same call as the greedy
engine path (bitwise the same token; no filtering, no generator touched).

`n` samples of one prompt are `n` requests (`for_sample(i)`): sample i's seed is
`seed + i` (vLLM's rule), so each sample is reproducible and they differ. `logprobs`
(vLLM's meaning): per generated token, the log-probability of the sampled token and
of the `logprobs` most likely ones, from the model's raw logits (log_softmax before
temperature / top-k / top-p, vLLM's default "raw_logprobs"); `token_logprobs` computes them.

Every rank samples the same token because only one sampler runs: the step loop's
(`cp_compile.serving.loop.step_loop.StepLoop`, under the driver of `LLM` and the server, and
under `hf.Engine.generate`), on the logits rank 0 returns; the token reaches every
rank in the next step's plan. A seeded request owns a `torch.Generator` seeded with
`seed`, so its tokens do not depend on what else is in the batch.

One `Sampler` serves both ways of sampling:

- per request (`sample`): each request brings its own `SamplingParams` and
  generator (the step loop);
- per batch (`probs`, `choose`): the sampler's own temperature / top-k / top-p and
  one generator seeded with `seed`, for speculative decoding, whose drafts and
  acceptance draw for a whole batch at once (cp_compile.serving.spec_decode).

`share` is the one token broadcast: rank 0's tokens replace every rank's (the
driver under torchrun, where every rank runs a driver on the same requests, and
speculative decoding, where every rank draws alike), so logits that differ in the
last bit between ranks cannot split the world.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field, replace
from typing import Mapping

import torch
import torch.distributed as dist

# What torch.Generator.manual_seed takes (vLLM's server bounds `seed` the same way).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class RequestError(ValueError):
    """A request the engine cannot serve, refused before it joins: `field` names the
    request field at fault (the server's HTTP 400 carries it). The message is
    `field=value: rule` unless `message` gives it whole."""

    def __init__(self, field_name: str, value: object, rule: str, message: str | None = None) -> None:
        shown = value if not isinstance(value, (list, tuple)) or len(value) <= 8 else f"[{len(value)} items]"
        super().__init__(message if message is not None else f"{field_name}={shown!r}: {rule}")
        self.field = field_name


class SamplingError(RequestError):
    """A bad sampling value."""


def _is_int(x: object) -> bool:
    """An integer, and not a bool (True is not a token id, a count or a seed)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_list_like(x: object) -> bool:
    """A list, tuple, array or 1-d tensor of values; not a string or a mapping."""
    return (not isinstance(x, (str, bytes, Mapping)) and hasattr(x, "__len__") and hasattr(x, "__iter__")
            and getattr(x, "ndim", 1) == 1)


def token_ids(prompt: object, vocab_size: int | None, index: int | None = None) -> list[int]:
    """One prompt's token ids as plain ints, or RequestError("prompt") naming the prompt
    (`index`, when there are several), the position and the value. Integer types
    (`operator.index`: int, numpy / 0-d tensor ints) pass; bool, float and str do not."""
    where = "" if index is None else f"prompt {index}: "
    if not is_list_like(prompt):
        raise RequestError("prompt", prompt, "", f"{where}{prompt!r} is not a list of token ids. Fix: pass one list "
                           "of token ids (ints) per prompt, e.g. [[1, 2, 3]] for one prompt")
    if not prompt:
        raise RequestError("prompt", list(prompt), "", f"{where}the prompt is empty. Fix: give at least one token")
    out = []
    for j, t in enumerate(prompt):
        try:
            if isinstance(t, bool) or getattr(t, "dtype", None) == torch.bool:
                raise TypeError
            v = operator.index(t)
        except TypeError:
            raise RequestError("prompt", t, "", f"{where}token {t!r} at position {j} is not an integer token id. "
                               "Fix: pass token ids (ints), e.g. from this model's tokenizer") from None
        if vocab_size is not None and not 0 <= v < vocab_size:
            raise RequestError("prompt", v, "", f"{where}token {v} at position {j} is outside the vocabulary [0, "
                               f"{vocab_size}). Fix: tokenize with this model's tokenizer")
        if v < 0:
            raise RequestError("prompt", v, "", f"{where}token {v} at position {j} is negative. Fix: pass token ids "
                               ">= 0, e.g. from this model's tokenizer")
        out.append(v)
    return out


@dataclass
class SamplingParams:
    """vLLM's `SamplingParams` subset: temperature 0 is greedy; top_k -1 / 0 and
    top_p 1 switch those filters off; `stop` strings end the text (not included);
    `ignore_eos` keeps generating past EOS."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None

    def __post_init__(self) -> None:
        self.validate()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids)

    def validate(self, vocab_size: int | None = None) -> None:
        """Every field's type and range (SamplingError naming the field, the value and the
        fix); `vocab_size` also bounds `stop_token_ids` and `logprobs`."""
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise SamplingError("temperature", t, "must be a finite number >= 0. Fix: 0 for greedy, e.g. 0.8 to "
                                "sample")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0 < p <= 1):
            raise SamplingError("top_p", p, "must be a number in (0, 1]. Fix: e.g. 0.95, or 1 for off")
        k = self.top_k
        if not _is_int(k) or (k < 1 and k not in (0, -1)):
            raise SamplingError("top_k", k, "must be -1 or 0 (off) or an integer >= 1. Fix: e.g. 50, or -1 for off")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingError("max_tokens", self.max_tokens, "must be an integer >= 1 (or None: up to "
                                "max_model_len). Fix: ask for at least one new token, as an int")
        if not _is_int(self.n) or self.n < 1:
            raise SamplingError("n", self.n, "must be an integer >= 1 (samples per prompt). Fix: e.g. 1")
        seed = self.seed
        if seed is not None and (not _is_int(seed) or not SEED_MIN <= seed <= SEED_MAX - (self.n - 1)):
            # sample i of n is seeded seed + i (for_sample): every one must fit torch's 64-bit seed.
            raise SamplingError("seed", seed, f"must be None or an integer in [{SEED_MIN}, {SEED_MAX}] (n={self.n} "
                                "samples use seed .. seed + n - 1). Fix: a smaller integer seed, e.g. 0")
        lp = self.logprobs
        if lp is not None and (not _is_int(lp) or lp < 0 or (vocab_size is not None and lp > vocab_size)):
            raise SamplingError("logprobs", lp, "must be None (off) or an integer in [0, vocab_size] (the number of "
                                "most likely tokens returned beside the sampled one). Fix: e.g. 5")
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if stop is not None and (not isinstance(stop, (list, tuple))
                                 or any(not isinstance(s, str) or not s for s in stop)):
            raise SamplingError("stop", self.stop, "must be a non-empty string or a list of them. Fix: e.g. "
                                "[\"\\n\"], or leave it out")
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(not _is_int(i) for i in ids):
            raise SamplingError("stop_token_ids", ids, "must be a list of integer token ids. Fix: e.g. [2], or []")
        if vocab_size is not None:
            bad = [i for i in ids if not 0 <= i < vocab_size]
            if bad:
                raise SamplingError("stop_token_ids", bad, f"ids must be in [0, {vocab_size}). Fix: ids of this "
                                    "model's tokenizer")
        if not isinstance(self.ignore_eos, bool):
            raise SamplingError("ignore_eos", self.ignore_eos, "must be true or false. Fix: a bool")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_sample(self, index: int) -> "SamplingParams":
        """Sample `index` of `n`: one request of its own (n = 1), seed + index when seeded."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


@dataclass(frozen=True)
class Logprob:
    """vLLM's `Logprob`: log-probability, 1-based rank in the vocabulary, the token's text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def token_logprobs(logits: torch.Tensor, token: int, top: int) -> dict[int, Logprob]:
    """logits [vocab] (raw) -> {token id: Logprob} for the `top` most likely tokens
    and the sampled `token` (vLLM's per-position dict; the sampled one first)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    out = {token: Logprob(float(lp[token]), int((lp > lp[token]).sum()) + 1)}
    if top > 0:
        vals, ids = torch.topk(lp, top)
        for r, (v, i) in enumerate(zip(vals.tolist(), ids.tolist())):
            out.setdefault(i, Logprob(v, r + 1))
    return out


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """[..., vocab] -> the same, scaled by 1 / temperature, -inf where top-k / top-p drop
    (HF's TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper in that order)."""
    x = logits.float() / temperature
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cum <= (1 - top_p)
        drop_sorted[..., -1:] = False  # keep at least the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def _collective_device(t: torch.Tensor) -> torch.device:
    """Where a broadcast of `t` can run: its own device, unless the world's backend
    has no CPU collectives (NCCL / HCCL), then the current accelerator."""
    backend = str(dist.get_backend())
    if t.device.type != "cpu" or "gloo" in backend:
        return t.device
    accel = getattr(torch, "accelerator", None)  # torch >= 2.6
    acc = accel.current_accelerator() if accel is not None else None
    if acc is None:  # no accelerator known: the backend must take CPU tensors
        return t.device
    return torch.device(acc.type, accel.current_device_index())


def share(t: torch.Tensor) -> torch.Tensor:
    """Global rank 0's `t` on every rank (in place; same shape and dtype everywhere);
    a no-op without a world of more than one rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dev = _collective_device(t)
        buf = t if dev == t.device else t.to(dev)
        dist.broadcast(buf, src=0)
        if buf is not t:
            t.copy_(buf)
    return t


def share_tokens(tokens: list[int]) -> list[int]:
    """`share` for the step loop's token list (one int64 broadcast)."""
    return share(torch.tensor(tokens, dtype=torch.int64)).tolist()


@dataclass
class Sampler:
    """Turns logits into tokens (see the module doc): `sample` per request with that
    request's params and generator; `probs` / `choose` per batch with this sampler's
    own params (temperature 0: greedy; > 0: softmax of the logits filtered by
    temperature, top_k (-1 / 0 off) and top_p (1 off)) and its generator seeded by
    `seed` (the same on every rank). Bad values raise `SamplingError` naming the field."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = -1
    top_p: float = 1.0
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed)
        self.generator = torch.Generator().manual_seed(self.seed)

    # ---- per request (the step loop) ----------------------------------------------
    def sample(self, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
        """One request's next token from its last-token logits [vocab]."""
        if params.greedy:
            return int(logits.argmax())  # the greedy engine path, bitwise
        probs = filter_logits(logits, params.temperature, params.top_k, params.top_p).softmax(-1)
        return int(torch.multinomial(probs, 1, generator=generator))

    @staticmethod
    def generator_for(params: SamplingParams, fallback: torch.Generator) -> torch.Generator | None:
        """A request's own generator: seeded by `seed`, else from the driver's stream."""
        if params.greedy:
            return None
        seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, (1,), generator=fallback))
        return torch.Generator().manual_seed(seed)

    # ---- per batch (speculative decoding) -----------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """[..., V] logits -> [..., V] fp32 probabilities after temperature, top-k, top-p."""
        return filter_logits(logits, self.temperature, self.top_k, self.top_p).softmax(dim=-1)

    def choose(self, logits: torch.Tensor) -> torch.Tensor:
        """[B, V] logits -> [B] int64 tokens, rank 0's on every rank (`share`)."""
        if self.greedy:
            tokens = logits.argmax(dim=-1)
        else:
            tokens = torch.multinomial(self.probs(logits).cpu(), 1, generator=self.generator)[:, 0]
        return share(tokens.to(torch.int64).cpu().contiguous())
