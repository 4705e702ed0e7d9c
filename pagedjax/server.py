"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both streaming),
/v1/models, /health, /metrics (Prometheus).

    pagedjax serve [MODEL] --port 8000 --max-outstanding-tokens 65536
    curl localhost:8000/v1/completions -d '{"prompt": "copy:hello=", "max_tokens": 8}'

Every request is validated before anything is queued; a bad one gets HTTP 400 with an
OpenAI-style error body naming the field ({"error": {"message", "type", "param", "code"}}),
admission control's refusal HTTP 429 with Retry-After, and the engine serves the rest either
way. A streaming client that disconnects has its request aborted and its blocks freed.
Sampling extensions beyond OpenAI's fields follow vLLM's names: top_k, stop_token_ids,
ignore_eos, skip_special_tokens, include_stop_str_in_output, cache_salt, return_token_ids.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import socket
import threading
import time
from typing import Any

import fastapi
from fastapi import responses
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field

from pagedjax.async_engine import (AsyncLLMEngine, EngineDeadError, OverloadedError,
                                   PromptSpec, RequestGroup)
from pagedjax.engine import LLMEngine
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.server_metrics import ServerMetrics
from scheduler import SamplingParams
from scheduler.simulator import prefix_hashes


# ---- request bodies ------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's API does."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    n: int = Field(1, ge=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0, lt=2**32)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    cache_salt: str | None = None
    return_token_ids: bool = False

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for fields with values this engine does not implement."""
        found = []
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                found.append((name, f"{name} is not supported (only 0)"))
        if self.logit_bias:
            found.append(("logit_bias", "logit_bias is not supported"))
        return found


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False
    suffix: str | None = None

    def unsupported(self):
        found = super().unsupported()
        if self.suffix:
            found.append(("suffix", "suffix is not supported"))
        if self.echo and self.logprobs is not None:
            found.append(("echo", "echo with logprobs (prompt logprobs) is not supported"))
        if self.stream and self.best_of is not None and self.best_of > self.n:
            found.append(("best_of", "best_of > n cannot stream (the best n are known only at "
                          "the end)"))
        return found


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self):
        found = super().unsupported()
        if self.tools:
            found.append(("tools", "tool calling is not supported"))
        if self.response_format and self.response_format.get("type", "text") != "text":
            found.append(("response_format", "only response_format {'type': 'text'} is "
                          "supported (no guided decoding)"))
        if self.top_logprobs is not None and not self.logprobs:
            found.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        return found


# ---- errors --------------------------------------------------------------------------------------

class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for error in exc.errors():
        loc = [str(x) for x in error.get("loc", ()) if x != "body"]
        field = ".".join(loc) or "body"
        param = param or (loc[0] if loc else None)
        got = f" (got {error['input']!r})" if "input" in error and loc else ""
        parts.append(f"{field}: {error.get('msg', 'invalid')}{got}")
    return "; ".join(parts), param


def _param_of(message: str) -> str | None:
    """The request field a ValueError from the engine names first ("max_tokens must be ...")."""
    head = message.split(" ", 1)[0].strip("(:,")
    if head in ("prompt_token_ids", "prompt"):
        return "prompt"
    return head if head.isidentifier() else None


REJECTED = {400: "invalid", 404: "invalid", 429: "overloaded"}  # status -> the metric's reason


# ---- the app -------------------------------------------------------------------------------------

class TraceRecorder:
    """Appends each finished request to a JSON-lines trace for `pagedjax simulate`: arrival
    (seconds since the server started), prompt and output lengths, samples, and the chained
    hashes of the prompt's 16-token pieces (which requests share a prefix; no tokens)."""

    def __init__(self, path: str, start: float):
        self.file = open(path, "a", buffering=1)
        self.start = start

    def record(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if not out.finished:
                continue
            record = {"arrival_s": round(out.metrics.arrival_time - self.start, 6),
                      "prompt_len": len(out.prompt_token_ids),
                      "output_len": max(1, max(len(c.token_ids) for c in out.outputs))}
            if len(out.outputs) > 1:
                record["n"] = len(out.outputs)
            if hashes := prefix_hashes(out.prompt_token_ids):
                record["prefix_hashes"] = list(hashes)
            self.file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.file.close()


class OpenAIServer:
    """The endpoints over one AsyncLLMEngine."""

    def __init__(self, engine: LLMEngine, served_model_name: str = "pagedjax", *,
                 max_outstanding_tokens: int | None = None, api_key: str | None = None,
                 trace_out: str | None = None):
        if not isinstance(served_model_name, str) or not served_model_name:
            raise ValueError(f"served_model_name must be a non-empty string, "
                             f"got {served_model_name!r}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name = served_model_name
        self.api_key = api_key
        self.created = int(time.time())
        self.metrics = ServerMetrics(engine, served_model_name)
        self.trace = TraceRecorder(trace_out, engine.clock()) if trace_out else None
        self.async_engine = AsyncLLMEngine(engine, max_outstanding_tokens=max_outstanding_tokens,
                                           on_step=self._on_step, on_abort=self.metrics.forget)

    def _on_step(self, info) -> None:  # the engine thread, after every step
        self.metrics.on_step(info)
        if self.trace is not None:
            self.trace.record(info.outputs)

    # ---- helpers ---------------------------------------------------------------------------

    def _check_model(self, body: _SamplingFields) -> None:
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} does not exist; this server serves "
                           f"{self.model_name!r}", "model", code="model_not_found")
        for param, why in body.unsupported():
            raise APIError(400, why, param)

    def _sampling(self, body: _SamplingFields, max_tokens: int, logprobs: int | None,
                  best_of: int | None = None) -> SamplingParams:
        kwargs: dict[str, Any] = dict(max_tokens=max_tokens, n=body.n, best_of=best_of,
                                      seed=body.seed, ignore_eos=body.ignore_eos,
                                      skip_special_tokens=body.skip_special_tokens,
                                      include_stop_str_in_output=body.include_stop_str_in_output,
                                      logprobs=logprobs)
        if body.temperature is not None:
            kwargs["temperature"] = body.temperature
        if body.top_p is not None:
            kwargs["top_p"] = body.top_p
        if body.top_k is not None:
            kwargs["top_k"] = -1 if body.top_k == 0 else body.top_k
        if body.stop:
            kwargs["stop"] = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
        if body.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(body.stop_token_ids)
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise APIError(400, str(e), _param_of(str(e))) from None

    def _encode(self, prompt: str | list[int], field: str) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, f"{field} is text but the model has no tokenizer: send "
                               "token ids", field)
            return self.tokenizer.encode(prompt), prompt
        return list(prompt), None

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _add(self, specs: list[PromptSpec]) -> RequestGroup:
        try:
            return await self.async_engine.add_requests(specs)
        except OverloadedError as e:
            raise APIError(429, str(e), None, "rate_limit_error", "server_overloaded",
                           {"Retry-After": "1"}) from None
        except ValueError as e:
            raise APIError(400, str(e), _param_of(str(e))) from None
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "server_error", "engine_dead") from None

    @staticmethod
    def _usage(outputs: dict[str, RequestOutput]) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in outputs.values())
        completion = sum(len(c.token_ids) for o in outputs.values() for c in o.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    # ---- completions -----------------------------------------------------------------------

    def _completion_logprobs(self, choice: CompletionOutput, start: int, offset: int) -> dict:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for token_id, top in zip(choice.token_ids[start:], (choice.logprobs or [])[start:]):
            text = self._token_text(token_id)
            tokens.append(text)
            token_logprobs.append(top.get(token_id))
            tops.append({self._token_text(t): lp for t, lp in top.items()})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
                "text_offset": offsets}

    async def completions(self, body: CompletionRequest, request: fastapi.Request):
        self._check_model(body)
        prompts = body.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "prompt must be non-empty (a string, token ids, or a non-empty "
                           "list of them)", "prompt")
        params = self._sampling(body, body.max_tokens or 16, body.logprobs, body.best_of)
        encoded = [self._encode(p, "prompt") for p in prompts]
        request_id = f"cmpl-{secrets.token_hex(12)}"
        specs = [PromptSpec(ids, params, f"{request_id}-{i}", text, body.cache_salt)
                 for i, (ids, text) in enumerate(encoded)]
        index_of = {spec.request_id: i for i, spec in enumerate(specs)}
        echo = [(text if text is not None else self.tokenizer.decode(ids))
                if body.echo and self.tokenizer is not None else "" for ids, text in encoded]
        group = await self._add(specs)
        created = int(time.time())
        n = body.n

        def choice_dict(out: RequestOutput, choice: CompletionOutput, text: str, start: int,
                        finish: str | None, offset: int) -> dict:
            d = {"index": index_of[out.request_id] * n + choice.index, "text": text,
                 "logprobs": (self._completion_logprobs(choice, start, offset)
                              if body.logprobs is not None else None),
                 "finish_reason": finish}
            if body.return_token_ids or self.tokenizer is None:  # no text without one
                d["token_ids"] = choice.token_ids[start:]
                if start == 0:
                    d["prompt_token_ids"] = out.prompt_token_ids
            return d

        base = {"id": request_id, "object": "text_completion", "created": created,
                "model": self.model_name}
        if not body.stream:
            final = await self._collect(group, request)
            choices = []
            for rid in (s.request_id for s in specs):
                out = final[rid]
                prefix = echo[index_of[rid]]
                for choice in out.outputs:
                    choices.append(choice_dict(out, choice, prefix + (choice.text or ""), 0,
                                               choice.finish_reason, len(prefix)))
            return {**base, "choices": choices, "usage": self._usage(final)}

        # Without a tokenizer there is no text: every token is news.
        per_token = body.logprobs is not None or body.return_token_ids or self.tokenizer is None

        async def events():
            sent: dict[tuple[str, int], tuple[int, int]] = {}  # (rid, index) -> (chars, tokens)
            final: dict[str, RequestOutput] = {}
            for i, prefix in enumerate(echo):
                for j in range(n):
                    if prefix:
                        yield _sse({**base, "choices": [{"index": i * n + j, "text": prefix,
                                                         "logprobs": None,
                                                         "finish_reason": None}]})
            async with group:
                async for out in group:
                    choices = []
                    for choice in out.outputs:
                        key = (out.request_id, choice.index)
                        chars, tokens = sent.get(key, (0, 0))
                        text = choice.text or ""
                        if choice.finish_reason is None and (
                                len(choice.token_ids) == tokens or len(text) == chars
                                and not per_token):
                            continue  # nothing new a client asked for (a held-back byte)
                        choices.append(choice_dict(out, choice, text[chars:], tokens,
                                                   choice.finish_reason,
                                                   len(echo[index_of[out.request_id]]) + chars))
                        sent[key] = (len(text), len(choice.token_ids))
                    if out.finished:
                        final[out.request_id] = out
                    if choices:
                        yield _sse({**base, "choices": choices})
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**base, "choices": [], "usage": self._usage(final)})
            yield "data: [DONE]\n\n"

        return responses.StreamingResponse(_guard(events()), media_type="text/event-stream")

    # ---- chat ------------------------------------------------------------------------------

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not hasattr(self.tokenizer, "apply_chat_template"):
            raise APIError(400, "chat needs a tokenizer with a chat template; this model has "
                           "none (use /v1/completions)", "messages")
        messages = []
        for i, message in enumerate(body.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content: only text parts are "
                                       f"supported, got type {part.get('type')!r}",
                                       "messages")
                    texts.append(part["text"])
                content = "".join(texts)
            messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
        try:
            return list(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                **(body.chat_template_kwargs or {})))
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None

    def _chat_logprobs(self, choice: CompletionOutput, start: int, top_n: int) -> dict:
        content = []
        for token_id, top in zip(choice.token_ids[start:], (choice.logprobs or [])[start:]):
            text = self._token_text(token_id)
            ranked = sorted(top.items(), key=lambda kv: -kv[1])[:top_n]
            content.append({
                "token": text, "logprob": top.get(token_id), "bytes": list(text.encode()),
                "top_logprobs": [{"token": (t := self._token_text(i)), "logprob": lp,
                                  "bytes": list(t.encode())} for i, lp in ranked]})
        return {"content": content}

    async def chat_completions(self, body: ChatCompletionRequest, request: fastapi.Request):
        self._check_model(body)
        ids = self._chat_prompt(body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        if max_tokens is None:  # as vLLM: whatever the context leaves
            max_tokens = max(1, self.engine.config.max_model_len - len(ids))
        top_n = body.top_logprobs or 0
        params = self._sampling(body, max_tokens, top_n if body.logprobs else None)
        request_id = f"chatcmpl-{secrets.token_hex(12)}"
        group = await self._add([PromptSpec(ids, params, request_id, None, body.cache_salt)])
        base = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name}

        def extra(out: RequestOutput, choice: CompletionOutput, start: int) -> dict:
            d = {}
            if body.logprobs:
                d["logprobs"] = self._chat_logprobs(choice, start, top_n)
            if body.return_token_ids:
                d["token_ids"] = choice.token_ids[start:]
            return d

        if not body.stream:
            out = (await self._collect(group, request))[request_id]
            choices = [{"index": c.index,
                        "message": {"role": "assistant", "content": c.text or ""},
                        "logprobs": None, **extra(out, c, 0), "finish_reason": c.finish_reason}
                       for c in out.outputs]
            return {**base, "choices": choices, "usage": self._usage({request_id: out})}

        chunk = {**base, "object": "chat.completion.chunk"}
        per_token = body.logprobs or body.return_token_ids or self.tokenizer is None

        async def events():
            yield _sse({**chunk, "choices": [
                {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None} for j in range(body.n)]})
            sent: dict[int, tuple[int, int]] = {}
            final = None
            async with group:
                async for out in group:
                    choices = []
                    for c in out.outputs:
                        chars, tokens = sent.get(c.index, (0, 0))
                        text = c.text or ""
                        if c.finish_reason is None and (
                                len(c.token_ids) == tokens or len(text) == chars
                                and not per_token):
                            continue  # nothing new a client asked for (a held-back byte)
                        delta = {"content": text[chars:]} if len(text) > chars else {}
                        choices.append({"index": c.index, "delta": delta, "logprobs": None,
                                        **extra(out, c, tokens), "finish_reason": c.finish_reason})
                        sent[c.index] = (len(text), len(c.token_ids))
                    final = out if out.finished else final
                    if choices:
                        yield _sse({**chunk, "choices": choices})
            if body.stream_options is not None and body.stream_options.include_usage:
                yield _sse({**chunk, "choices": [], "usage": self._usage({request_id: final})})
            yield "data: [DONE]\n\n"

        return responses.StreamingResponse(_guard(events()), media_type="text/event-stream")

    async def _collect(self, group: RequestGroup, request: fastapi.Request
                       ) -> dict[str, RequestOutput]:
        """Every request's finished output; aborts them if the client disconnects first."""
        final: dict[str, RequestOutput] = {}
        try:
            async with group:
                async for out in group:
                    if out.finished:
                        final[out.request_id] = out
                    elif await request.is_disconnected():
                        break
        except EngineDeadError as e:
            raise APIError(503, str(e), None, "server_error", "engine_dead") from None
        return final

    # ---- the app ---------------------------------------------------------------------------

    def build_app(self) -> fastapi.FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            if not self.async_engine.healthy:
                self.async_engine.start()
            try:
                yield
            finally:
                self.async_engine.shutdown()
                if self.trace is not None:
                    self.trace.close()

        app = fastapi.FastAPI(title="pagedjax", lifespan=lifespan)
        app.state.server = self

        @app.exception_handler(APIError)
        async def api_error(request, exc: APIError):
            if exc.status in REJECTED:
                self.metrics.rejected(REJECTED[exc.status])
            return responses.JSONResponse(
                error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                headers=exc.headers)

        @app.exception_handler(RequestValidationError)
        async def validation_error(request, exc: RequestValidationError):
            self.metrics.rejected("invalid")
            message, param = _validation_message(exc)
            return responses.JSONResponse(error_body(message, "invalid_request_error", param),
                                          status_code=400)

        @app.middleware("http")
        async def check_api_key(request: fastapi.Request, call_next):
            if (self.api_key is not None and request.url.path.startswith("/v1")
                    and request.headers.get("authorization") != f"Bearer {self.api_key}"):
                return responses.JSONResponse(
                    error_body("missing or wrong API key (Authorization: Bearer ...)",
                               "authentication_error", None, "invalid_api_key"),
                    status_code=401)
            return await call_next(request)

        @app.get("/health")
        async def health():
            if not self.async_engine.healthy:
                return responses.JSONResponse(
                    error_body(self.async_engine._dead_reason(), "server_error"),
                    status_code=503)
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{
                "id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pagedjax", "max_model_len": self.engine.config.max_model_len}]}

        @app.get("/metrics")
        async def metrics():
            return responses.Response(self.metrics.render(),
                                      media_type="text/plain; version=0.0.4; charset=utf-8")

        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        return app


async def _guard(events):
    """A stream whose engine dies mid-way ends with an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as e:
        yield _sse(error_body(str(e), "server_error", None, "engine_dead"))
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # a client that went away: abort its requests now


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def build_app(engine: LLMEngine, served_model_name: str = "pagedjax", *,
              max_outstanding_tokens: int | None = None,
              api_key: str | None = None) -> fastapi.FastAPI:
    """The FastAPI app serving `engine` (its engine thread starts with the app's lifespan)."""
    return OpenAIServer(engine, served_model_name, max_outstanding_tokens=max_outstanding_tokens,
                        api_key=api_key).build_app()



def run_server(engine: LLMEngine, served_model_name: str = "pagedjax", *, host: str = "127.0.0.1",
               port: int = 8000, log_level: str = "info", **server_kwargs) -> None:
    """Serves until interrupted (uvicorn; SIGINT / SIGTERM stop it after in-flight responses).
    server_kwargs: OpenAIServer's (max_outstanding_tokens, api_key, trace_out)."""
    import uvicorn

    app = OpenAIServer(engine, served_model_name, **server_kwargs).build_app()
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises SIGINT once shut down
        uvicorn.run(app, host=host, port=port, log_level=log_level)


class BackgroundServer:
    """An ASGI app under uvicorn in a background thread (a notebook, a benchmark, a test):

        with BackgroundServer(build_app(engine)) as url:   # http://127.0.0.1:PORT
            ...

    port 0 picks a free one."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.uvicorn = uvicorn.Server(uvicorn.Config(app, host=host, port=port,
                                                     log_level=log_level))
        self.thread = threading.Thread(target=self.uvicorn.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        while not self.uvicorn.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self.url

    def __exit__(self, *exc) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(60)
