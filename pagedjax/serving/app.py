"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both streaming),
/v1/models (and /v1/models/{id}), vLLM's /tokenize, /detokenize and /version, /health, /metrics
(Prometheus).

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
import time

import fastapi
from fastapi import responses

from pagedjax import __version__
from pagedjax.engine.admission import encode_text
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import RequestOutput
from pagedjax.serving import chat, completions, openapi, reasoning, tokenization
from pagedjax.serving.admin import PATHS as ADMIN_PATHS, admin_routes
from pagedjax.serving.admission_control import AdmissionLimits
from pagedjax.serving.degradation import (DegradationController, DegradationPolicy,
                                          settings_for)
from pagedjax.serving.async_engine import (AsyncLLMEngine, EngineDeadError, OverloadedError,
                                           PromptSpec, RequestFailedError, RequestGroup)
from pagedjax.serving.core_client import CoreClient
from pagedjax.serving.http_common import (DEFAULT_MAX_REQUEST_BYTES, APIError,
                                          GuardMiddleware, error_body, get_route,
                                          install_error_handlers)
from pagedjax.serving.metrics import ServerMetrics
from pagedjax.serving.protocol import ChatCompletionRequest, _SamplingFields, usage_json
from pagedjax.serving.request_params import rejected, sampling_params, trace_note
from pagedjax.serving.response_store import DEFAULT_MAX_ENTRIES, DEFAULT_TTL_S, ResponseStore
from pagedjax.serving.responses import responses_routes
from pagedjax.serving.serving_config import ConfigHistory, ServingConfig, engine_fields
from pagedjax.serving.tool_parsers import get_parser
from pagedjax.serving.trace_recorder import TraceRecorder
from pagedjax.text.tokenizer import check_chat_template
from pagedjax.scheduler import RequestError, SamplingParams

DEFAULT_MAX_TOKENS = 512  # a chat request's when it gives none (vLLM: the context's remainder)
REJECTED = {400: "invalid", 404: "invalid", 413: "invalid", 429: "overloaded"}  # -> reason
# (admission control's 429s carry their own: pagedjax.serving.admission_control.REASONS)


class OpenAIServer:
    """The endpoints over one AsyncLLMEngine."""

    def __init__(self, engine: LLMEngine, served_model_name: str = "pagedjax", *,
                 max_outstanding_tokens: int | None = None, api_key: str | None = None,
                 trace_out: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 public_metrics: bool = False, chat_template: str | None = None,
                 admission: AdmissionLimits | None = None, max_tokens_cap: int | None = None,
                 default_max_tokens: int | None = DEFAULT_MAX_TOKENS,
                 degradation: DegradationPolicy | None = None,
                 config: ServingConfig | None = None, admin_key: str | None = None,
                 tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False,
                 reasoning_parser: str | None = None,
                 responses_store_size: int = DEFAULT_MAX_ENTRIES,
                 responses_store_ttl_s: float = DEFAULT_TTL_S,
                 enable_prompt_tokens_details: bool = False):
        """engine: an LLMEngine (stepped on a thread of this process, AsyncLLMEngine) or a
        started engine core (pagedjax.serving.core_client.CoreClient: the engine in a process
        of its own). api_key guards every route but /health (and /metrics with public_metrics, for a
        scraper); bodies over max_request_bytes answer 413 unread; chat_template replaces the
        tokenizer's (a model with neither refuses chat requests, 400).

        The serving configuration, as a versioned ServingConfig (config), or by its parts:
        admission (admission control's rules; max_outstanding_tokens alone is the token
        budget's shorthand), max_tokens_cap (every request's max_tokens is cut to it, its
        response saying so in X-PagedJAX-Max-Tokens-Capped), default_max_tokens (a chat
        request's when it gives none; None: what the context leaves, as vLLM) and degradation
        (pagedjax.serving.degradation). admin_key enables /admin/config (new versions, live)
        and /admin/config/rollback behind it. enable_auto_tool_choice with tool_call_parser
        (a name of pagedjax.serving.tool_parsers.PARSERS) serves tool_choice "auto";
        reasoning_parser (pagedjax.serving.reasoning.PARSERS) splits a thinking model's reasoning
        from its answer. The Responses API keeps up to responses_store_size responses (0:
        none) for responses_store_ttl_s seconds. enable_prompt_tokens_details adds the prompt
        tokens served from the prefix cache to every usage object (prompt_tokens_details)."""
        core = engine if isinstance(engine, CoreClient) else None
        engine = core.engine if core is not None else engine
        if config is None:
            if admission is not None and max_outstanding_tokens is not None:
                raise ValueError("give max_outstanding_tokens inside admission, not beside it")
            admission = admission or AdmissionLimits(max_outstanding_tokens=max_outstanding_tokens)
            config = ServingConfig(
                "default", engine=engine_fields(engine.config), admission=admission,
                max_tokens_cap=max_tokens_cap, default_max_tokens=default_max_tokens,
                degradation=degradation or DegradationPolicy())
        elif (admission, max_tokens_cap, degradation, max_outstanding_tokens) != (
                None, None, None, None) or default_max_tokens != DEFAULT_MAX_TOKENS:
            raise ValueError("give the serving settings in config or as arguments, not both")
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
        if enable_auto_tool_choice != (tool_call_parser is not None):
            raise ValueError("give enable_auto_tool_choice and tool_call_parser together "
                             "(--enable-auto-tool-choice --tool-call-parser NAME)")
        self.tool_parser = get_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = reasoning.get_parser(reasoning_parser) if reasoning_parser \
            else None
        self.prompt_tokens_details = bool(enable_prompt_tokens_details)
        self.responses = ResponseStore(responses_store_size, responses_store_ttl_s)
        self.background_responses: dict[str, asyncio.Future] = {}
        for name, key in (("api_key", api_key), ("admin_key", admin_key)):
            if key is not None and (not isinstance(key, str) or not key):
                raise ValueError(f"{name} must be None or a non-empty string")
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be an integer >= 1, "
                             f"got {max_request_bytes!r}")
        self.api_key, self.admin_key = api_key, admin_key
        self.max_request_bytes = max_request_bytes
        self.open_paths = ("/health", "/metrics") if public_metrics else ("/health",)
        self.created = int(time.time())
        self.degradation = DegradationController(config.degradation, apply=self._apply_level)
        self.metrics = ServerMetrics(engine.stats, served_model_name, observer=self.degradation,
                                     held_memory=engine.held_memory)
        self.degradation.on_change = self.metrics.degradation_changed
        self.trace = TraceRecorder(trace_out, engine.clock()) if trace_out else None
        if core is None:
            self.async_engine = AsyncLLMEngine(engine, limits=config.admission,
                                               on_step=self._on_step, on_abort=self._on_abort)
        else:
            self.async_engine = core
            core.on_step, core.on_abort = self._on_step, self._on_abort
        self.configs = ConfigHistory(config)
        self.apply_config(config)

    def apply_config(self, config: ServingConfig) -> None:
        """Serves the next requests with config's server settings (in-flight requests keep
        theirs); the caller has checked that its engine settings are the running ones."""
        self.admission = config.admission  # as configured; degradation derives from it
        self.max_tokens_cap = config.max_tokens_cap
        self.default_max_tokens = config.default_max_tokens
        self.degradation.policy = config.degradation
        self._apply_level(self.degradation.level)
        self.metrics.serving_config.info({"version": config.version})

    def _on_step(self, info) -> None:  # each step's report (engine thread or core's reader)
        self.metrics.on_step(info)
        self.degradation.evaluate()
        if self.trace is not None:
            self.trace.record(info.outputs)

    # ---- helpers ---------------------------------------------------------------------------

    def check_model_name(self, model: str | None, param: str | None = "model") -> None:
        """404 unless `model` is None or the served model's name."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves "
                           f"{self.model_name!r}", param, code="model_not_found")

    def check_model(self, body: _SamplingFields) -> None:
        self.check_model_name(body.model)
        for param, why in body.unsupported():
            raise APIError(400, why, param)

    def sampling(self, body: _SamplingFields, max_tokens: int, logprobs: int | None,
                 best_of: int | None, params_of: dict[str, str],
                 prompt_logprobs: int | None = None,
                 constraint: tuple[str, dict] | None = None) -> SamplingParams:
        prediction = body.prediction_text()  # its shape checked with the body's fields
        if prediction is not None:
            try:
                prediction = encode_text(self.tokenizer, prediction, "prediction",
                                         add_special_tokens=False)
            except RequestError as e:
                raise APIError(400, str(e), "prediction") from None
        return sampling_params(body, max_tokens, logprobs, best_of, params_of, prompt_logprobs,
                               constraint, prediction)

    async def encode(self, prompt: str | list, field: str) -> tuple[list, str | None]:
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

    def max_tokens(self, requested: int | None, default: int) -> tuple[int, int | None]:
        """(the max_tokens a request runs with, the cap that cut it or None): the requested
        value (default when none) cut to --max-tokens-cap and to degradation's cap."""
        value = default if requested is None else requested
        caps = [c for c in (self.max_tokens_cap, self.degradation.max_tokens_cap) if c]
        if caps and value > min(caps):
            return min(caps), min(caps)
        return value, None

    @staticmethod
    def respond(content: dict, capped: int | None) -> responses.JSONResponse:
        return responses.JSONResponse(content, headers=_capped_header(capped))

    @staticmethod
    def stream(events, capped: int | None) -> responses.StreamingResponse:
        return responses.StreamingResponse(events, media_type="text/event-stream",
                                           headers=_capped_header(capped))

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def add(self, specs: list[PromptSpec], params_of: dict[str, str],
                  body: _SamplingFields | None = None, request: fastapi.Request | None = None,
                  turns: int | None = None) -> RequestGroup:
        """Queues specs (all or none); with a trace, notes what the trace records of them
        from body and request (session, stream, workload; turns: chat's earlier turns)."""
        self.degradation.evaluate()  # an idle instance recovers too
        noted = self.trace is not None and body is not None
        if noted:
            note = trace_note(body, request, turns)
            for spec in specs:
                self.trace.annotate(spec.request_id, **note)
        try:
            return await self.async_engine.add_requests(
                specs, streamed=True if body is None else bool(body.stream))
        except BaseException as e:
            if noted:
                for spec in specs:
                    self.trace.forget(spec.request_id)
            if isinstance(e, OverloadedError):
                raise APIError(429, str(e), None, "rate_limit_error", "server_overloaded",
                               {"Retry-After": "1"}, reason=e.reason) from None
            if isinstance(e, RequestError):
                raise rejected(e, params_of) from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), None, "server_error", "engine_dead") from None
            raise

    def _apply_level(self, level: int) -> None:
        """The instance's knobs for a degradation level, derived from the configured ones (so
        recovering restores them)."""
        limits, cap = settings_for(level, self.degradation.policy, self.admission,
                                   self.max_tokens_cap or self.engine.config.max_model_len,
                                   self.engine.config.max_model_len,
                                   self.async_engine.num_live)
        self.degradation.max_tokens_cap = cap
        self.async_engine.limits = limits

    def _on_abort(self, request_id: str) -> None:  # a client went away before it finished
        self.metrics.forget(request_id)
        if self.trace is not None:
            self.trace.forget(request_id)

    def usage(self, outputs: dict[str, RequestOutput], prediction: bool = False) -> dict:
        """OpenAI's usage of a request's outputs; prediction: it sent Predicted Outputs (the
        drafts its prediction gave, accepted and rejected, are reported)."""
        cached = sum(o.metrics.num_cached_tokens for o in outputs.values())
        drafted = sum(o.metrics.num_draft_tokens for o in outputs.values())
        accepted = sum(o.metrics.num_accepted_draft_tokens for o in outputs.values())
        return usage_json(sum(len(o.prompt_token_ids) for o in outputs.values()),
                          sum(len(c.token_ids) for o in outputs.values() for c in o.outputs),
                          cached if self.prompt_tokens_details else None,
                          (accepted, drafted - accepted) if prediction else None)

    def gone(self) -> responses.Response:
        return responses.Response(status_code=499)  # nobody reads it: the client has gone

    def model_card(self) -> dict:
        """The served model as /v1/models lists it (with its serving configuration's version)."""
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "pagedjax", "root": self.model_name, "parent": None,
                "max_model_len": self.engine.config.max_model_len,
                "config_version": self.configs.active.version}

    # ---- the endpoints (pagedjax.serving.completions, .chat, .tokenization) ----------------

    async def tokenize(self, request: fastapi.Request):
        return await tokenization.tokenize(self, request)

    async def detokenize(self, request: fastapi.Request):
        return await tokenization.detokenize(self, request)

    async def completions(self, request: fastapi.Request):
        return await completions.completions(self, request)

    def chat_prompt(self, body: ChatCompletionRequest, tools=None) -> list[int]:
        return chat.render_prompt(self, body, tools)

    async def chat_completions(self, request: fastapi.Request):
        return await chat.chat_completions(self, request)

    async def collect(self, group: RequestGroup, request: fastapi.Request
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

        def on_error(error: APIError) -> None:
            reason = error.reason or REJECTED.get(error.status)
            if reason is not None:
                self.metrics.rejected(reason)

        install_error_handlers(app, on_error)
        # The admin routes answer to the admin key alone (an API key would shut them).
        open_paths = self.open_paths + (ADMIN_PATHS if self.admin_key is not None else ())
        app.add_middleware(GuardMiddleware, max_request_bytes=self.max_request_bytes,
                           api_key=self.api_key, open_paths=open_paths)

        @get_route(app, "/health")
        async def health():
            if not self.async_engine.healthy:
                return responses.JSONResponse(
                    error_body(self.async_engine.dead_reason(), "server_error"),
                    status_code=503)
            return {"status": "ok"}

        @get_route(app, "/v1/models")
        async def models():
            return {"object": "list", "data": [self.model_card()]}

        @get_route(app, "/v1/models/{model:path}")
        async def model(model: str):
            self.check_model_name(model, param=None)
            return self.model_card()

        @get_route(app, "/version")
        async def version():
            return {"version": __version__}

        @get_route(app, "/metrics")
        async def metrics():
            self.degradation.evaluate()
            return responses.Response(self.metrics.render(),
                                      media_type="text/plain; version=0.0.4; charset=utf-8")

        if self.admin_key is not None:
            admin_routes(self, app)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat_completions)
        responses_routes(self, app)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        openapi.install(app)
        return app


def _capped_header(capped: int | None) -> dict[str, str] | None:
    return None if capped is None else {"X-PagedJAX-Max-Tokens-Capped": str(capped)}


async def _disconnected(request: fastapi.Request) -> None:
    """Returns when the client has gone away (the body is read: the next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(engine: LLMEngine, served_model_name: str = "pagedjax",
              **server_kwargs) -> fastapi.FastAPI:
    """The FastAPI app serving `engine` (an LLMEngine, whose engine thread starts with the app's
    lifespan, or a started core_client.CoreClient);
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
