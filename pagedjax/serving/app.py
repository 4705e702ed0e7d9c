"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions (both streaming),
/v1/models (and /v1/models/{id}), vLLM's /tokenize, /detokenize and /version, /health, /metrics
(Prometheus); with --runner pooling, the pooling routes instead of the generation ones
(pagedjax.serving.pooling_routes: /v1/embeddings, /pooling, /classify, /score, /rerank).

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
import logging

import fastapi
from fastapi import responses

from pagedjax import __version__
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.frontend.core_client import CoreClient
from pagedjax.serving import chat, completions, openapi, tokenization
from pagedjax.serving.admin import PATHS as ADMIN_PATHS, admin_routes
from pagedjax.serving.http_common import (APIError, GuardMiddleware, error_body, get_route,
                                          install_error_handlers)
from pagedjax.serving.lora_routes import lora_routes
from pagedjax.serving.pooling_routes import runner_routes
from pagedjax.serving.responses import responses_routes
from pagedjax.serving.server_state import DEFAULT_MAX_TOKENS, ServerState  # noqa: F401
from pagedjax.serving.weight_routes import PATHS as WEIGHT_PATHS, weight_routes

logger = logging.getLogger("pagedjax.http")
REJECTED = {400: "invalid", 404: "invalid", 413: "invalid", 429: "overloaded"}  # -> reason
# (admission control's 429s carry their own: pagedjax.frontend.admission_control.REASONS)


class OpenAIServer(ServerState):
    """The endpoints over one engine front-end (ServerState: what they share)."""

    # ---- the endpoints (pagedjax.serving.completions, .chat, .tokenization) ----------------

    async def tokenize(self, request: fastapi.Request):
        return await tokenization.tokenize(self, request)

    async def detokenize(self, request: fastapi.Request):
        return await tokenization.detokenize(self, request)

    async def completions(self, request: fastapi.Request):
        return await completions.completions(self, request)

    async def chat_completions(self, request: fastapi.Request):
        return await chat.chat_completions(self, request)

    # ---- the app ---------------------------------------------------------------------------

    def _info_routes(self, app: fastapi.FastAPI) -> None:
        """/health, /v1/models (and one model), /version, /metrics."""

        @get_route(app, "/health")
        async def health():
            if not self.async_engine.healthy:
                return responses.JSONResponse(
                    error_body(self.async_engine.dead_reason(), "server_error"),
                    status_code=503)
            return {"status": "ok"}

        @get_route(app, "/v1/models")
        async def models():
            return {"object": "list", "data": self.model_cards()}

        @get_route(app, "/v1/models/{model:path}")
        async def model(model: str):
            self.check_model_name(model, param=None)
            return next(card for card in self.model_cards() if card["id"] == model)

        @get_route(app, "/version")
        async def version():
            return {"version": __version__}

        @get_route(app, "/metrics")
        async def metrics():
            self.degradation.evaluate()
            return responses.Response(self.metrics.render(),
                                      media_type="text/plain; version=0.0.4; charset=utf-8")

    def build_app(self) -> fastapi.FastAPI:
        """The FastAPI app: its lifespan starts and stops the engine's front-end."""

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
        open_paths = self.open_paths + (ADMIN_PATHS + WEIGHT_PATHS
                                        if self.admin_key is not None else ())
        app.add_middleware(GuardMiddleware, max_request_bytes=self.max_request_bytes,
                           api_key=self.api_key, open_paths=open_paths)

        self._info_routes(app)
        if self.admin_key is not None:
            admin_routes(self, app)
            weight_routes(self, app)
        if self.engine.runner_type == "generate":
            app.post("/v1/completions")(self.completions)
            app.post("/v1/chat/completions")(self.chat_completions)
            responses_routes(self, app)
        runner_routes(self, app)  # the pooling routes, or their refusal
        if self.loras is not None and self.loras.runtime_updates:
            lora_routes(self, app)
        app.post("/tokenize")(self.tokenize)
        app.post("/detokenize")(self.detokenize)
        openapi.install(app)
        return app


def build_app(engine: LLMEngine, served_model_name: str = "pagedjax",
              **server_kwargs) -> fastapi.FastAPI:
    """The FastAPI app serving `engine` (an LLMEngine, whose engine thread starts with the app's
    lifespan, or a started core_client.CoreClient);
    server_kwargs: OpenAIServer's."""
    return OpenAIServer(engine, served_model_name, **server_kwargs).build_app()


def run_server(engine: LLMEngine, served_model_name: str = "pagedjax", *, host: str = "127.0.0.1",
               port: int = 8000, log_level: str = "info", **server_kwargs) -> int:
    """Serves until interrupted (uvicorn; SIGINT / SIGTERM stop it after in-flight responses)
    and returns 0; or, when the engine core's process dies, fails its requests (503), stops
    and returns 1, so that a supervisor restarts the whole server (vLLM's API server exits when
    its engine dies). server_kwargs: OpenAIServer's (max_outstanding_tokens, api_key, ...)."""
    import uvicorn

    server = OpenAIServer(engine, served_model_name, **server_kwargs)
    http = uvicorn.Server(uvicorn.Config(server.build_app(), host=host, port=port,
                                         log_level=log_level, timeout_graceful_shutdown=5))
    died: list[str] = []

    def on_death(reason: str) -> None:
        logger.error("%s: the server stops (exit status 1) for a supervisor to restart it",
                     reason)
        died.append(reason)
        http.should_exit = True

    if isinstance(server.async_engine, CoreClient):  # an engine core in a process of its own
        server.async_engine.on_death = on_death
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises SIGINT once shut down
        http.run()
    return 1 if died else 0
