"""The server's OpenAPI document, made real: every POST route's request body is its pydantic
model (the handlers parse bodies themselves, strictly, so FastAPI cannot see them), every route's
answers are documented (the JSON models below, server-sent events where a route streams,
OpenAI's error body for each error status), and /metrics is text/plain. Documentation only:
nothing here validates or filters what a handler returns."""

from __future__ import annotations

from typing import Any

import fastapi
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from pagedjax.serving.pooling_protocol import (ClassificationRequest, EmbeddingRequest,
                                               PoolingRequest, RerankRequest, ScoreRequest)
from pagedjax.serving.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                       TokenizeChatRequest, TokenizeCompletionRequest)
from pagedjax.serving.responses_input import ResponsesRequest
from pagedjax.serving.weight_routes import (PauseRequest, SleepRequest, UpdateWeightsRequest,
                                            WakeUpRequest)


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(_Open):
    error: ErrorDetail


class Usage(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class ChatMessageOut(_Open):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None


class ChatChoice(_Open):
    index: int
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ResponseObject(_Open):
    id: str
    object: str
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class ResponseDeleted(_Open):
    id: str
    object: str
    deleted: bool


class ModelCard(_Open):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Open):
    object: str
    data: list[ModelCard]


class TokenizeResponse(_Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Open):
    prompt: str


class Health(_Open):
    status: str


class Version(_Open):
    version: str


class AdminStatus(_Open):
    active: dict[str, Any]
    versions: list[str]
    degradation_level: int


class WeightInfo(_Open):
    weight_version: str
    is_paused: bool
    is_sleeping: bool


class SleepingFlag(_Open):
    is_sleeping: bool


class WeightUpdated(_Open):
    weight_version: str


class PausedFlag(_Open):
    is_paused: bool


class PrefixCacheReset(_Open):
    reset: bool


class PoolingUsage(_Open):
    prompt_tokens: int
    total_tokens: int


class _PoolingList(_Open):
    id: str
    object: str
    created: int
    model: str
    usage: PoolingUsage


class EmbeddingData(_Open):
    index: int
    object: str
    embedding: list[float] | str  # str: encoding_format base64


class EmbeddingResponse(_PoolingList):
    data: list[EmbeddingData]


class PoolingData(_Open):
    index: int
    object: str
    data: list[Any] | str


class PoolingResponse(_PoolingList):
    data: list[PoolingData]


class ClassificationData(_Open):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(_PoolingList):
    data: list[ClassificationData]


class ScoreData(_Open):
    index: int
    object: str
    score: float


class ScoreResponse(_PoolingList):
    data: list[ScoreData]


class RerankResult(_Open):
    index: int
    relevance_score: float
    document: dict[str, str] | None = None


class RerankResponse(_Open):
    id: str
    model: str
    results: list[RerankResult]
    usage: dict[str, int]


STREAMS = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
REQUESTS: dict[str, Any] = {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest, "/detokenize": DetokenizeRequest,
    "/tokenize": (TokenizeCompletionRequest, TokenizeChatRequest),
    "/update_weights": UpdateWeightsRequest, "/pause": PauseRequest, "/sleep": SleepRequest,
    "/wake_up": WakeUpRequest, "/v1/embeddings": EmbeddingRequest, "/pooling": PoolingRequest,
    "/classify": ClassificationRequest, "/score": ScoreRequest, "/v1/score": ScoreRequest,
    "/rerank": RerankRequest, "/v1/rerank": RerankRequest, "/v2/rerank": RerankRequest}
ANSWERS: dict[tuple[str, str], Any] = {
    ("post", "/v1/completions"): CompletionResponse,
    ("post", "/v1/chat/completions"): ChatCompletionResponse,
    ("post", "/v1/responses"): ResponseObject,
    ("get", "/v1/responses/{response_id}"): ResponseObject,
    ("post", "/v1/responses/{response_id}/cancel"): ResponseObject,
    ("delete", "/v1/responses/{response_id}"): ResponseDeleted,
    ("get", "/v1/models"): ModelList, ("get", "/v1/models/{model}"): ModelCard,
    ("post", "/tokenize"): TokenizeResponse, ("post", "/detokenize"): DetokenizeResponse,
    ("get", "/health"): Health, ("get", "/version"): Version,
    ("get", "/admin/config"): AdminStatus, ("post", "/admin/config"): AdminStatus,
    ("post", "/admin/config/rollback"): AdminStatus,
    ("post", "/update_weights"): WeightUpdated, ("post", "/pause"): WeightInfo,
    ("post", "/resume"): WeightInfo, ("get", "/weight_info"): WeightInfo,
    ("get", "/is_paused"): PausedFlag, ("post", "/reset_prefix_cache"): PrefixCacheReset,
    ("post", "/sleep"): WeightInfo, ("post", "/wake_up"): WeightInfo,
    ("get", "/is_sleeping"): SleepingFlag,
    ("post", "/v1/embeddings"): EmbeddingResponse, ("post", "/pooling"): PoolingResponse,
    ("post", "/classify"): ClassificationResponse, ("post", "/score"): ScoreResponse,
    ("post", "/v1/score"): ScoreResponse, ("post", "/rerank"): RerankResponse,
    ("post", "/v1/rerank"): RerankResponse, ("post", "/v2/rerank"): RerankResponse}
ERRORS = {400: "a field the server cannot serve, named in `param`",
          401: "a missing or wrong API (or admin) key", 404: "no such model, response or route",
          405: "a method the route does not take",
          409: "a configuration needing a new instance, or a reset while blocks are held",
          413: "a body over --max-request-bytes",
          429: "refused by admission control (Retry-After)", 499: "the client went away",
          500: "an internal error (a request id to find it in the log)",
          503: "the engine is dead", 504: "requests still in flight past timeout_s"}


def _schema(models, components: dict) -> dict:
    """The JSON schema of a model (or a union of them), its definitions moved to components."""
    if isinstance(models, tuple):
        return {"anyOf": [_schema(m, components) for m in models]}
    schema = models.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(schema.pop("$defs", {}))
    components[models.__name__] = schema
    return {"$ref": f"#/components/schemas/{models.__name__}"}


def _json(schema: dict) -> dict:
    return {"application/json": {"schema": schema}}


def document(app: fastapi.FastAPI) -> dict:
    """FastAPI's document of app, with the bodies and answers above filled in."""
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="pagedjax: an OpenAI- and vLLM-compatible LLM server.")
    components = doc.setdefault("components", {}).setdefault("schemas", {})
    error = _schema(ErrorResponse, components)
    for path, operations in doc.get("paths", {}).items():
        plain = path.replace("{model:path}", "{model}")
        for method, operation in operations.items():
            if method == "head":
                operation["responses"] = {"200": {"description": "the GET's headers"}}
                continue
            if method == "post" and plain in REQUESTS:
                operation["requestBody"] = {"required": True,
                                            "content": _json(_schema(REQUESTS[plain],
                                                                     components))}
            answer = ANSWERS.get((method, plain))
            content = _json(_schema(answer, components)) if answer else None
            if plain == "/metrics":
                content = {"text/plain": {"schema": {"type": "string"}}}
            if plain in STREAMS and method == "post":
                content = content or {}
                content["text/event-stream"] = {"schema": {
                    "type": "string", "description": "server-sent events (stream: true)"}}
            responses = {"200": {"description": "OK", **({"content": content}
                                                          if content else {})}}
            responses.update({str(status): {"description": why, "content": _json(error)}
                              for status, why in ERRORS.items()})
            operation["responses"] = responses
    return doc


def install(app: fastapi.FastAPI) -> None:
    """app.openapi() (and /openapi.json, /docs) answers the document above, built once."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = document(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented override
