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

import asyncio
import contextlib
import json
import secrets
import socket
import threading
import time
from typing import Any

import fastapi
from fastapi import responses

from pagedjax.engine.admission import encode_text
from pagedjax.serving.async_engine import (AsyncLLMEngine, EngineDeadError, OverloadedError,
                                   PromptSpec, RequestFailedError, RequestGroup)
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.serving.http_common import (DEFAULT_MAX_REQUEST_BYTES, APIError, GuardMiddleware,
                                  error_body, install_error_handlers, parse_body)
from pagedjax.engine.outputs import CompletionOutput, RequestOutput
from pagedjax.serving.protocol import (ChatCompletionRequest, CompletionRequest, _SamplingFields,
                               split_prompts)
from pagedjax.serving.metrics import ServerMetrics
from pagedjax.text.tokenizer import NO_CHAT_TEMPLATE, check_chat_template
from pagedjax.serving.trace_recorder import TraceRecorder
from scheduler import RequestError, SamplingParams

REJECTED = {400: "invalid", 404: "invalid", 413: "invalid", 429: "overloaded"}  # -> reason


class OpenAIServer:
    """The endpoints over one AsyncLLMEngine."""

    def __init__(self, engine: LLMEngine, served_model_name: str = "pagedjax", *,
                 max_outstanding_tokens: int | None = None, api_key: str | None = None,
                 trace_out: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 public_metrics: bool = False, chat_template: str | None = None):
        """api_key guards every route but /health (and /metrics with public_metrics, for a
        scraper); bodies over max_request_bytes answer 413 unread; chat_template replaces the
        tokenizer's (a model with neither refuses chat requests, 400)."""
        if not isinstance(served_model_name, str) or not served_model_name:
            raise ValueError(f"served_model_name must be a non-empty string, "
                             f"got {served_model_name!r}")
        self.engine = engine
        self.tokenizer = engine.tokenizer
        if chat_template is not None:
            if self.tokenizer is None:
                raise ValueError("chat_template needs a tokenizer; this engine has none")
            check_chat_template(chat_template)
        self.chat_template = chat_template or getattr(self.tokenizer, "chat_template", None)
        self.model_name = served_model_name
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise ValueError("api_key must be None or a non-empty string")
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be an integer >= 1, "
                             f"got {max_request_bytes!r}")
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.open_paths = ("/health", "/metrics") if public_metrics else ("/health",)
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
                  best_of: int | None, params_of: dict[str, str]) -> SamplingParams:
        kwargs: dict[str, Any] = dict(max_tokens=max_tokens, n=body.n, best_of=best_of,
                                      seed=body.seed, ignore_eos=body.ignore_eos,
                                      skip_special_tokens=body.skip_special_tokens,
                                      include_stop_str_in_output=body.include_stop_str_in_output,
                                      logprobs=logprobs, stop=body.stop,
                                      stop_token_ids=tuple(body.stop_token_ids or ()))
        if body.temperature is not None:
            kwargs["temperature"] = body.temperature
        if body.top_p is not None:
            kwargs["top_p"] = body.top_p
        if body.top_k is not None:
            kwargs["top_k"] = -1 if body.top_k == 0 else body.top_k
        try:
            return SamplingParams(**kwargs)
        except RequestError as e:
            raise _rejected(e, params_of) from None

    async def _encode(self, prompt: str | list, field: str) -> tuple[list, str | None]:
        """Token ids of a text prompt (tokenized off the event loop) or the ids as given (the
        engine checks them)."""
        if not isinstance(prompt, str):
            return prompt, None
        try:
            if len(prompt) < 4096:
                return encode_text(self.tokenizer, prompt, field), prompt
            return await asyncio.to_thread(encode_text, self.tokenizer, prompt, field), prompt
        except RequestError as e:
            raise APIError(400, str(e), field) from None

    def _token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def _add(self, specs: list[PromptSpec], params_of: dict[str, str]) -> RequestGroup:
        try:
            return await self.async_engine.add_requests(specs)
        except OverloadedError as e:
            raise APIError(429, str(e), None, "rate_limit_error", "server_overloaded",
                           {"Retry-After": "1"}) from None
        except RequestError as e:
            raise _rejected(e, params_of) from None
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

    async def completions(self, request: fastapi.Request):
        body = parse_body(await request.body(), CompletionRequest)
        self._check_model(body)
        try:
            prompts = split_prompts(body.prompt)
        except ValueError as e:
            raise APIError(400, str(e), "prompt") from None
        params_of = {"prompt_token_ids": "prompt", "prompts": "prompt"}
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = self._sampling(body, max_tokens, body.logprobs, body.best_of, params_of)
        encoded = [await self._encode(p, "prompt") for p in prompts]
        request_id = f"cmpl-{secrets.token_hex(12)}"
        specs = [PromptSpec(ids, params, f"{request_id}-{i}", text, body.cache_salt)
                 for i, (ids, text) in enumerate(encoded)]
        index_of = {spec.request_id: i for i, spec in enumerate(specs)}
        group = await self._add(specs, params_of)
        echo = [(text if text is not None else self.tokenizer.decode(list(ids)))
                if body.echo and self.tokenizer is not None else "" for ids, text in encoded]
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
            if final is None:
                return _gone()
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
        if self.chat_template is None:
            raise APIError(400, NO_CHAT_TEMPLATE, "messages")
        messages = []
        for i, message in enumerate(body.messages):
            content = message.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content: only text parts "
                                       "({'type': 'text', 'text': str}) are supported",
                                       "messages")
                    texts.append(part["text"])
                content = "".join(texts)
            messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
        try:
            return list(self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, tokenize=True,
                chat_template=self.chat_template, **(body.chat_template_kwargs or {})))
        except Exception as e:  # noqa: BLE001 - a template error is the caller's input
            raise APIError(400, f"messages: the chat template failed: {str(e)[:200]}",
                           "messages") from None

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

    async def chat_completions(self, request: fastapi.Request):
        body = parse_body(await request.body(), ChatCompletionRequest)
        self._check_model(body)
        ids = await asyncio.to_thread(self._chat_prompt, body)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        if max_tokens is None:  # as vLLM: whatever the context leaves
            max_tokens = max(1, self.engine.config.max_model_len - len(ids))
        top_n = body.top_logprobs or 0
        params_of = {"prompt_token_ids": "messages", "prompts": "messages",
                     "logprobs": "top_logprobs",
                     "max_tokens": ("max_completion_tokens"
                                    if body.max_completion_tokens is not None else "max_tokens")}
        params = self._sampling(body, max_tokens, top_n if body.logprobs else None, None,
                                params_of)
        request_id = f"chatcmpl-{secrets.token_hex(12)}"
        group = await self._add([PromptSpec(ids, params, request_id, None, body.cache_salt)],
                                params_of)
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
            final = await self._collect(group, request)
            if final is None:
                return _gone()
            out = final[request_id]
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
                       ) -> dict[str, RequestOutput] | None:
        """Every request's finished output, or None when the client disconnected first (its
        requests are aborted and their blocks freed at once)."""
        final: dict[str, RequestOutput] = {}

        async def collect():
            async for out in group:
                if out.finished:
                    final[out.request_id] = out

        async with group:
            collecting = asyncio.ensure_future(collect())
            gone = asyncio.ensure_future(_disconnected(request))
            try:
                await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                finished = collecting.done()
                gone.cancel()
                collecting.cancel()  # a no-op once it is done
            if not finished:
                return None
            try:
                collecting.result()
            except EngineDeadError as e:
                raise APIError(503, str(e), None, "server_error", "engine_dead") from None
            except RequestFailedError as e:
                raise APIError(500, str(e), None, "server_error", "request_failed") from None
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
                if not self.async_engine.running:
                    self.async_engine.engine.close()  # a multi-host leader stops its followers
                if self.trace is not None:
                    self.trace.close()

        app = fastapi.FastAPI(title="pagedjax", lifespan=lifespan)
        app.state.server = self

        def on_error(status: int) -> None:
            if status in REJECTED:
                self.metrics.rejected(REJECTED[status])

        install_error_handlers(app, on_error)
        app.add_middleware(GuardMiddleware, max_request_bytes=self.max_request_bytes,
                           api_key=self.api_key, open_paths=self.open_paths)

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


def _rejected(error: RequestError, params_of: dict[str, str]) -> APIError:
    """The engine's RequestError as HTTP 400, its field spelled as the endpoint's body does."""
    field = error.field
    param = params_of.get(field, field) if field not in ("sampling_params", "request_id") else None
    return APIError(400, str(error), param)


async def _disconnected(request: fastapi.Request) -> None:
    """Returns when the client has gone away (the body is read: the next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _gone() -> responses.Response:
    return responses.Response(status_code=499)  # nobody reads it: the client has gone


async def _guard(events):
    """A stream whose engine dies mid-way ends with an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as e:
        yield _sse(error_body(str(e), "server_error", None, "engine_dead"))
        yield "data: [DONE]\n\n"
    except RequestFailedError as e:
        yield _sse(error_body(str(e), "server_error", None, "request_failed"))
        yield "data: [DONE]\n\n"
    finally:
        await events.aclose()  # a client that went away: abort its requests now


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def build_app(engine: LLMEngine, served_model_name: str = "pagedjax",
              **server_kwargs) -> fastapi.FastAPI:
    """The FastAPI app serving `engine` (its engine thread starts with the app's lifespan);
    server_kwargs: OpenAIServer's."""
    return OpenAIServer(engine, served_model_name, **server_kwargs).build_app()


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
