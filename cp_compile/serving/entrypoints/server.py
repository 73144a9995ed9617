"""OpenAI-compatible HTTP server over `cp_compile.LLM` (FastAPI + uvicorn).

    cp-compile serve /path/to/ckpt --tensor-parallel-size 2 --decode-context-parallel-size 2 \\
        --prefill-context-parallel-size 2 --host 127.0.0.1 --port 8000

Endpoints: `/v1/completions`, `/v1/chat/completions` (both with `stream`), `/v1/models`,
`/health`, and `/v1/cp_compile/stats` (scheduler and KV-block figures, ours).

PD disaggregation (`--kv-transfer-config`, vLLM's proxy flow): a completion request
may carry vLLM's `kv_transfer_params`; a kv_producer server prefills (max_tokens 1)
and returns the consumer's `kv_transfer_params` in the response, a kv_consumer server
imports the KV they name and decodes. A failed import answers that request with HTTP
500 naming the cause (its blocks freed); the server keeps serving.

An engine that cannot step any more (a worker rank died: the executor notices any dead
rank within a fraction of a second; or a rank hung: no answer to a step within
`--step-timeout-s`, compiles not counted, decision 57) fails every request in flight or still arriving
(HTTP 503, or an error event on a stream), `/health` answers 503 with the reason (while
healthy it lists the `worker_pids`), and `serve` returns 1 after `EXIT_GRACE_S`, which
`cp-compile serve` exits with, for a process manager to restart it (decision 55).

Continuous batching: one engine thread owns the driver and steps it while any
request runs; HTTP handlers check a request (`Driver.check`: reads only fixed
limits, so it is safe off that thread), then hand it over through a queue, and
receive its tokens through an asyncio queue. A request joins the running batch at
the next step. A client that disconnects (a closed stream, or a non-streaming
request whose connection drops) is aborted before the engine's next step: a watcher
task per request waits on the ASGI `http.disconnect`, and the scheduler frees its KV
blocks in the next plan. Bad requests get HTTP 400 with OpenAI's error body, `param`
naming the field, the message its value and the fix; an unknown model gets 404
(`code` model_not_found, as OpenAI and vLLM answer); the server keeps serving.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' `Request` annotation at
# run time, and fastapi is imported inside build_app (an optional dependency).

import asyncio
import json
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from cp_compile.serving.entrypoints import openai_logprobs
from cp_compile.serving.entrypoints.executors import SpawnedExecutor
from cp_compile.serving.entrypoints.llm import LLM, TextState
from cp_compile.serving.loop.scheduler import Sequence
from cp_compile.serving.kv_transfer import KVTransferError
from cp_compile.base.sampling import RequestError, SamplingParams, token_ids


@dataclass
class Stream:
    """One request's events, from the engine thread to its handler's event loop."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # shared by a request's n samples
    index: int = 0  # which of the n samples
    seq: Sequence | None = None
    text: TextState | None = None


class EngineLoop:
    """The thread that steps the driver (see module doc)."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.commands: queue.Queue = queue.Queue()
        self.max_batch_seen = 0
        self.requests_served = 0
        self.error: BaseException | None = None
        self.failed = threading.Event()  # set once the engine cannot step any more (serve exits then)
        self._live: dict[int, Stream] = {}  # rid -> stream of each request not yet finished
        self._done: list[Stream] = []  # finished in this step: told after it (a producer exports at its end)
        self._stop = False
        self._next_check = 0.0  # when the idle loop next looks for a dead worker
        self._thread = threading.Thread(target=self._run, name="cp-compile-engine", daemon=True)
        self._thread.start()

    def submit(self, ids: list[int], params: SamplingParams, stream: Stream, kv_params: dict | None = None) -> None:
        self.commands.put(("add", ids, params, stream, kv_params))

    def abort(self, stream: Stream) -> None:
        self.commands.put(("abort", stream))

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, ids, params, stream, kv_params = cmd

            def on_update(seq: Sequence, text: TextState, stream: Stream = stream) -> None:
                if seq.finish_reason is not None or text.stop_reason is not None:
                    self._done.append(stream)  # its last event goes after the step (its kv_transfer_params)
                else:
                    stream.loop.call_soon_threadsafe(stream.events.put_nowait, ("token", stream.index, False))

            try:
                stream.seq, stream.text = self.llm.submit(ids, params, on_update, kv_transfer_params=kv_params)
                self._live[stream.seq.rid] = stream
            except Exception as e:  # noqa: BLE001 - reported to the handler (checked before, so rare)
                stream.loop.call_soon_threadsafe(stream.events.put_nowait, ("error", stream.index, e))
        elif cmd[0] == "abort":
            seq = cmd[1].seq
            if seq is not None:
                self._live.pop(seq.rid, None)
            if seq is not None and seq.finish_reason is None:
                self.llm.driver.abort(seq)

    def _run(self) -> None:
        driver = self.llm.driver
        while not self._stop:
            try:
                block = not driver.has_work()
                cmd = self.commands.get(timeout=0.05) if block else self.commands.get_nowait()
                self._apply(cmd)
                continue  # drain every pending command before the next step
            except queue.Empty:
                pass
            if not driver.has_work() and time.monotonic() >= self._next_check:
                # Idle: no step would notice a dead worker, so /health would answer 200 until
                # the next request failed on it.
                self._next_check = time.monotonic() + 0.5
                dead = getattr(self.llm.executor, "dead_worker", lambda: None)()
                if dead is not None:
                    self._fail_all(dead)
                    return
            if driver.has_work():
                try:
                    updated = driver.step()
                except KVTransferError as e:  # a failed import fails its requests, not the server
                    self._fail_imports(e)
                    continue
                except BaseException as e:  # noqa: BLE001 - the server reports it on /health, then exits
                    self._flush_done()
                    self._fail_all(e)
                    return
                finally:
                    self._flush_done()
                self.max_batch_seen = max(self.max_batch_seen, len(updated))
                self.requests_served += sum(s.finish_reason is not None for s in updated)

    def _fail_all(self, exc: BaseException) -> None:
        """The engine cannot step any more (a worker died, ...): every request in flight and
        every one still arriving gets an error event instead of waiting forever (issue 35
        item 6); `serve` then exits non-zero for a process manager to restart the server."""
        self.error = EngineFailed(f"engine failed: {type(exc).__name__}: {exc}. Fix: restart the server (it exits "
                                  "with code 1 so that a process manager can; requests in flight were answered "
                                  "with this error)")
        self.error.__cause__ = exc
        self.failed.set()
        while not self._stop:
            for stream in self._live.values():
                stream.loop.call_soon_threadsafe(stream.events.put_nowait, ("error", stream.index, self.error))
            self._live.clear()
            try:
                cmd = self.commands.get(timeout=0.05)
            except queue.Empty:
                continue
            if cmd[0] == "add":  # submitted before the handler saw self.error
                stream = cmd[3]
                stream.loop.call_soon_threadsafe(stream.events.put_nowait, ("error", stream.index, self.error))

    def _flush_done(self) -> None:
        for stream in self._done:
            self._live.pop(stream.seq.rid, None)
            stream.loop.call_soon_threadsafe(stream.events.put_nowait, ("token", stream.index, True))
        self._done.clear()

    def _fail_imports(self, exc: KVTransferError) -> None:
        """The consumer's driver aborted the requests whose KV import failed (the ranks
        freed their blocks): answer each with its cause."""
        failed = getattr(self.llm.driver.kv_side, "failed", {})
        for rid in [r for r in self._live if r in failed]:
            stream = self._live.pop(rid)
            err = KVTransferError(f"KV import failed (nothing of it is attended; its blocks are free): "
                                  f"{failed.pop(rid)}")
            stream.loop.call_soon_threadsafe(stream.events.put_nowait, ("error", stream.index, err))
        self.llm.driver.drop([])  # free the aborted requests' blocks now

    def stats(self) -> dict[str, Any]:
        d = self.llm.driver
        eng = getattr(self.llm.executor, "engine", None)
        return dict(running=len(d.scheduler.running), waiting=len(d.scheduler.waiting),
                    reserved_blocks=d.scheduler.reserved, steps=d.steps, max_batch_seen=self.max_batch_seen,
                    requests_finished=self.requests_served,
                    free_blocks=eng.alloc.num_free if eng is not None else None,
                    num_blocks=d.limits.num_blocks)

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=10)


class EngineFailed(RuntimeError):
    """The engine thread stopped for good (a worker died, ...): HTTP 503 until the server exits."""


class ModelNotFound(RequestError):
    """A request for a model this server does not serve: HTTP 404, OpenAI's model_not_found."""


def _error(message: str, param: str | None, status: int = 400) -> Any:
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": {400: "BadRequestError", 503: "ServiceUnavailableError"}.get(
            status, "InternalServerError"),
        "param": param, "code": status}})


def _model_not_found(e: ModelNotFound) -> Any:
    """OpenAI's answer to an unknown model (vLLM's status): 404, type invalid_request_error,
    code model_not_found."""
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=404, content={"error": {
        "message": str(e), "type": "invalid_request_error", "param": e.field, "code": "model_not_found"}})


_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "max_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "n")


def _sampling(body: dict[str, Any], chat: bool) -> SamplingParams:
    kw = {k: body[k] for k in _SAMPLING_FIELDS if k in body and body[k] is not None}
    if chat:  # chat: `logprobs` is a bool, `top_logprobs` the count
        on, top = body.get("logprobs"), body.get("top_logprobs")
        if on is not None and not isinstance(on, bool):
            raise RequestError("logprobs", on, "must be true or false in a chat request (top_logprobs: the count). "
                               "Fix: \"logprobs\": true, \"top_logprobs\": 5")
        if top is not None and not on:
            raise RequestError("top_logprobs", top, "needs logprobs: true. Fix: add \"logprobs\": true")
        if on:
            kw["logprobs"] = 0 if top is None else top
    elif body.get("logprobs") is not None:
        kw["logprobs"] = body["logprobs"]
    kw.setdefault("max_tokens", 16 if "messages" not in body else None)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        kw["max_tokens"] = body["max_completion_tokens"]
    return SamplingParams(**kw)


def build_app(llm: LLM, served_model_name: str) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI(title="cp-compile")
    engine = EngineLoop(llm)
    app.state.engine = engine
    created = int(time.time())

    def prompt_ids(body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) and "content" in m for m in msgs):
                raise RequestError("messages", msgs, "must be a non-empty list of {role, content} objects. Fix: "
                                   "[{\"role\": \"user\", \"content\": \"...\"}]")
            tok = llm.tokenizer
            if tok is None:
                raise RequestError("messages", "...", "the model directory has no tokenizer. Fix: use "
                                   "/v1/completions with token ids")
            if getattr(tok, "chat_template", None):
                return list(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                    return_dict=True)["input_ids"])
            return llm.encode(" ".join(str(m["content"]) for m in msgs))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if llm.tokenizer is None:
                raise RequestError("prompt", prompt[:20], "the model directory has no tokenizer. Fix: send token "
                                   "ids")
            return llm.encode(prompt)
        if isinstance(prompt, list) and not any(isinstance(t, (str, list)) for t in prompt):
            try:
                return token_ids(prompt, llm.driver.limits.vocab_size)
            except RequestError as e:
                raise RequestError("prompt", prompt, "", f"prompt: {e}") from None
        raise RequestError("prompt", type(prompt).__name__, "must be a string or a list of token ids (one prompt "
                           "per request). Fix: \"prompt\": \"text\" or \"prompt\": [1, 2, 3]")

    def check(body: dict[str, Any], chat: bool) -> tuple[list[int], SamplingParams, dict | None]:
        if body.get("model") not in (served_model_name, None):
            raise ModelNotFound("model", body.get("model"), f"the model does not exist here. Fix: use "
                                f"{served_model_name!r} (this server's one model, GET /v1/models), or leave it out")
        params = _sampling(body, chat)
        ids = prompt_ids(body, chat)
        kv_params = body.get("kv_transfer_params")
        llm.driver.check(ids, params, kv_params)
        return ids, params, kv_params

    async def run(request: Request, chat: bool) -> Any:
        if engine.error is not None:
            return _error(str(engine.error), None, 503)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error("the body is not JSON", "body")
        if not isinstance(body, dict):
            return _error("the body must be a JSON object", "body")
        try:
            ids, params, kv_params = check(body, chat)
        except ModelNotFound as e:
            return _model_not_found(e)
        except RequestError as e:
            return _error(str(e), e.field)
        except (TypeError, ValueError) as e:
            return _error(str(e), None)
        # n samples are n requests (sample i seeded seed + i), all reporting to one queue.
        events: asyncio.Queue = asyncio.Queue()
        streams = [Stream(asyncio.get_running_loop(), events, index=i) for i in range(params.n)]
        for i, stream in enumerate(streams):
            engine.submit(ids, params.for_sample(i), stream, kv_params)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        model = served_model_name
        extra = {"token_ids"} if body.get("return_token_ids") else set()
        decode = llm.decode_token if llm.tokenizer is not None else str

        def usage() -> dict[str, int]:
            n_out = sum(len(st.seq.output) for st in streams if st.seq is not None)
            return {"prompt_tokens": len(ids), "completion_tokens": n_out, "total_tokens": len(ids) + n_out}

        def finish_reason(stream: Stream) -> str | None:
            # A stop string is seen before the engine thread marks the request finished.
            if stream.text is not None and stream.text.stop_reason is not None:
                return "stop"
            return None if stream.seq is None else stream.seq.finish_reason

        def logprobs(stream: Stream, start: int, stop: int, offset: int) -> dict[str, Any] | None:
            """OpenAI's logprobs object for output tokens [start, stop) of one sample."""
            if params.logprobs is None:
                return None
            toks, entries = stream.seq.output[start:stop], stream.seq.payload.logprobs[start:stop]
            if chat:
                return openai_logprobs.chat_logprobs(toks, entries, decode, params.logprobs)
            return openai_logprobs.completion_logprobs(toks, entries, decode, offset)

        def abort_all() -> None:
            for stream in streams:
                engine.abort(stream)  # frees its KV; no-op when finished

        async def watch_disconnect() -> None:
            """Abort this request as soon as its client goes (streaming or not): waits on
            the ASGI `http.disconnect` (the body is read already), so the engine thread
            gets the abort before its next step, however fast tokens come."""
            while (await request.receive())["type"] != "http.disconnect":
                pass
            abort_all()
            events.put_nowait(("gone", 0, None))

        watcher = asyncio.create_task(watch_disconnect())

        if body.get("stream"):
            async def sse() -> AsyncIterator[str]:
                sent = [""] * len(streams)  # text sent per sample
                sent_tok = [0] * len(streams)  # tokens whose logprobs were sent
                left = len(streams)
                try:
                    if chat:
                        for st in streams:
                            yield _sse(rid, model, created, chat, st.index, {"role": "assistant", "content": ""},
                                       None)
                    while left:
                        kind, index, payload = await events.get()
                        if kind == "gone":
                            return
                        if kind == "error":
                            yield f"data: {json.dumps({'error': {'message': str(payload)}})}\n\n"
                            break
                        st = streams[index]
                        text, n_tok = st.text.text, len(st.seq.output)
                        delta, offset, sent[index] = text[len(sent[index]):], len(sent[index]), text
                        reason = finish_reason(st) if payload else None
                        lp = logprobs(st, sent_tok[index], n_tok, offset) if n_tok > sent_tok[index] else None
                        sent_tok[index] = n_tok
                        if delta or reason or lp:
                            chunk = {"content": delta} if chat else delta
                            yield _sse(rid, model, created, chat, index, chunk, reason,
                                       list(st.seq.output) if "token_ids" in extra and reason else None, lp)
                        left -= bool(payload)
                    yield "data: [DONE]\n\n"
                finally:
                    watcher.cancel()
                    abort_all()  # a closed stream (client gone) frees its KV
            return StreamingResponse(sse(), media_type="text/event-stream")

        left = len(streams)
        try:
            while left:
                kind, index, payload = await events.get()
                if kind == "gone":  # the watcher aborted it: nobody reads this answer
                    return JSONResponse(status_code=499, content={})
                if kind == "error":
                    abort_all()
                    status = 400 if isinstance(payload, (RequestError, ValueError)) else \
                        503 if isinstance(payload, EngineFailed) else 500
                    return _error(str(payload), getattr(payload, "field", None), status)
                left -= bool(payload)
        finally:
            watcher.cancel()
        choices = []
        for st in streams:
            text, reason, lp = st.text.text, finish_reason(st), logprobs(st, 0, len(st.seq.output), 0)
            choice: dict[str, Any] = ({"index": st.index, "message": {"role": "assistant", "content": text},
                                       "logprobs": lp, "finish_reason": reason} if chat else
                                      {"index": st.index, "text": text, "logprobs": lp, "finish_reason": reason})
            if extra:
                choice["token_ids"] = list(st.seq.output)
            choices.append(choice)
        # vLLM's field: a kv_producer's answer carries what the kv_consumer needs (None elsewhere).
        kv_out = streams[0].seq.payload.kv_transfer_params if streams[0].seq is not None else None
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                "model": model, "choices": choices, "usage": usage(), "kv_transfer_params": kv_out}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        return await run(request, chat=True)

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": served_model_name, "object": "model", "created": created,
                                            "owned_by": "cp-compile", "max_model_len": llm.driver.limits.max_model_len}]}

    @app.get("/health")
    async def health() -> Any:
        if engine.error is not None:  # 503 with the reason, until serve() exits
            return _error(str(engine.error), None, 503)
        return JSONResponse({"worker_pids": list(getattr(llm.executor, "pids", [os.getpid()]))})

    @app.get("/v1/cp_compile/stats")
    async def stats() -> Any:
        return engine.stats()

    @app.on_event("shutdown")
    def shutdown() -> None:
        engine.close()

    return app


def _sse(rid: str, model: str, created: int, chat: bool, index: int, delta: Any, reason: str | None,
         token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None) -> str:
    if chat:
        choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
    else:
        choice = {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    obj = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": [choice]}
    return f"data: {json.dumps(obj)}\n\n"


EXIT_GRACE_S = 5.0  # after an engine failure: /health answers 503 with the reason this long, then the exit


def serve(llm: LLM, served_model_name: str, host: str = "127.0.0.1", port: int = 8000) -> int:
    """Serve until stopped (returns 0) or until the engine fails (returns 1, after
    EXIT_GRACE_S): the server does not restart its workers itself, a process manager
    restarts the whole server (docs/decisions.md, engine failure)."""
    import uvicorn

    app = build_app(llm, served_model_name)
    engine: EngineLoop = app.state.engine
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))

    def exit_on_failure() -> None:
        engine.failed.wait()
        print(f"cp-compile serve: {engine.error}; exiting with code 1 in {EXIT_GRACE_S:.0f} s", file=sys.stderr,
              flush=True)
        time.sleep(EXIT_GRACE_S)
        server.should_exit = True

    threading.Thread(target=exit_on_failure, name="cp-compile-exit-on-failure", daemon=True).start()
    try:
        server.run()
    finally:
        engine.close()
        if engine.error is not None:
            # The workers cannot be trusted to answer a close (one is dead, a peer may be
            # blocked in a collective with it): killed, not waited for; then the LLM is
            # marked closed so its atexit hook does not try again.
            llm.executor.close(**({"force": True} if isinstance(llm.executor, SpawnedExecutor) else {}))
            llm._closed = True
        else:
            llm.close()
    return 1 if engine.error is not None else 0
