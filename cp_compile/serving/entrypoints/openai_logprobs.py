"""Per-token logprobs (the driver's `Logprob` dicts) in OpenAI's two response shapes.

Completions (`logprobs: N`): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
one entry per generated token; `top_logprobs[i]` maps token text -> logprob for the
N most likely tokens and the sampled one (vLLM's shape).
Chat (`logprobs: true, top_logprobs: N`): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [N x {"token", "logprob", "bytes"}]}]}`.
"""

from __future__ import annotations

from typing import Any, Callable

from cp_compile.base.sampling import Logprob


def completion_logprobs(tokens: list[int], entries: list[dict[int, Logprob]], decode: Callable[[int], str],
                        offset: int = 0) -> dict[str, Any]:
    """`offset`: characters of text before these tokens (a stream's later chunks)."""
    texts = [decode(t) for t in tokens]
    offsets = []
    for s in texts:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": texts, "token_logprobs": [e[t].logprob for t, e in zip(tokens, entries)],
            "top_logprobs": [{decode(i): lp.logprob for i, lp in e.items()} for e in entries],
            "text_offset": offsets}


def chat_logprobs(tokens: list[int], entries: list[dict[int, Logprob]], decode: Callable[[int], str],
                  top: int) -> dict[str, Any]:
    def one(token: int, lp: float) -> dict[str, Any]:
        s = decode(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for t, e in zip(tokens, entries):
        best = sorted((lp.rank, i) for i, lp in e.items() if lp.rank <= top)[:top]
        content.append({**one(t, e[t].logprob), "top_logprobs": [one(i, e[i].logprob) for _, i in best]})
    return {"content": content}
