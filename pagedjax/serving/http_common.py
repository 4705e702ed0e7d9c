"""What the server and the router share at the HTTP edge: OpenAI error bodies, a defensive JSON
body parser, constant-time key checks, and GuardMiddleware (body limit, API key, internal
errors), a plain ASGI middleware so that a handler still sees its client disconnect.

No error body echoes the client's input: messages name the field and the limit only.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Iterable

import pydantic
from fastapi import responses
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("pagedjax.http")

DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
MAX_JSON_DEPTH = 200  # pydantic's JSON parser (jiter) refuses deeper nesting
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "not_found_error", 405: "invalid_request_error",
               413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, reason: str | None = None):
        """reason: why a request was refused, for the rejection counter (not sent)."""
        super().__init__(message)
        self.status, self.message, self.param, self.reason = status, message, param, reason
        self.type = type_ or ERROR_TYPES.get(status, "invalid_request_error")
        self.code, self.headers = code, headers


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None,
                   type_: str | None = None, code: Any = None,
                   headers: dict[str, str] | None = None) -> responses.JSONResponse:
    return responses.JSONResponse(
        error_body(message, type_ or ERROR_TYPES.get(status, "invalid_request_error"), param,
                   code), status_code=status, headers=headers)


def validation_error(errors: Sequence[Mapping]) -> APIError:
    """A 400 from pydantic's errors: the first one's field and message, never its input."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc)
    message = first.get("msg", "invalid value")
    if "recursion limit exceeded" in message:  # valid JSON, maybe: too deep for the parser
        message = (f"the body nests objects and arrays deeper than this server parses (about "
                   f"{MAX_JSON_DEPTH} levels; {message.split(': ', 1)[-1]})")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError(400, f"{where}: {message}{more}" if where else f"{message}{more}", param)


def parse_body(raw: bytes, model: type[pydantic.BaseModel]):
    """raw as an instance of model, or APIError 400 naming the field (invalid UTF-8, JSON, deep
    nesting or huge numbers included: pydantic's parser bounds its recursion)."""
    try:
        return model.model_validate_json(raw, strict=True)
    except pydantic.ValidationError as e:
        raise validation_error(e.errors(include_input=False, include_url=False)) from None


_JSON_OBJECT = pydantic.TypeAdapter(dict[str, Any])


def parse_json_object(raw: bytes) -> dict:
    """raw as a JSON object (the router's view of a body it forwards), or APIError 400."""
    try:
        return _JSON_OBJECT.validate_json(raw)
    except pydantic.ValidationError as e:
        error = e.errors(include_input=False, include_url=False)[0]
        what = "a JSON object" if error.get("type") == "dict_type" else "valid JSON"
        raise APIError(400, f"body must be {what}: {error.get('msg', '')[:200]}") from None


def get_route(app, path: str):
    """app.get(path) that answers HEAD too (load testers probe with it; the document lists the
    GET alone)."""
    def register(handler):
        app.api_route(path, methods=["GET"])(handler)
        app.api_route(path, methods=["HEAD"], include_in_schema=False)(handler)
        return handler
    return register


def key_matches(header: str | None, key: str) -> bool:
    """Whether an Authorization header carries `Bearer key`, compared in constant time."""
    expected = f"Bearer {key}".encode()
    return secrets.compare_digest((header or "").encode("utf-8", "replace"), expected)


def install_error_handlers(app, on_error=None) -> None:
    """Every error the framework raises (unknown route, wrong method, body errors, APIError)
    answers OpenAI's error body; on_error(the APIError) counts it."""

    def answer(exc: APIError):
        if on_error is not None:
            on_error(exc)
        return error_response(exc.status, exc.message, exc.param, exc.type, exc.code,
                              exc.headers)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return answer(exc)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request, exc: RequestValidationError):
        return answer(validation_error(list(exc.errors()) or [{"msg": "invalid request"}]))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else "error"
        return answer(APIError(exc.status_code, detail, headers=getattr(exc, "headers", None)))


class GuardMiddleware:
    """Plain ASGI middleware in front of an app:

    - bodies over max_request_bytes answer 413 before anything parses them (the body is read
      here, bounded, and replayed to the app; later receive() calls pass through, so a handler
      still sees http.disconnect);
    - with api_key, every path but open_paths needs `Authorization: Bearer <key>` (401);
    - an exception a handler did not answer becomes a 500 with a request id, logged with its
      traceback; the server goes on.
    """

    def __init__(self, app, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 api_key: str | None = None, open_paths: Iterable[str] = ("/health",)):
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be an integer >= 1, "
                             f"got {max_request_bytes!r}")
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key
        self.open_paths = frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", ())}
        if (self.api_key is not None and scope["path"] not in self.open_paths
                and not key_matches(headers.get("authorization"), self.api_key)):
            return await error_response(401, "missing or wrong API key (Authorization: Bearer "
                                        "...)", code="invalid_api_key")(scope, receive, send)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_request_bytes:
            return await self._too_large(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_request_bytes:
                return await self._too_large(scope, receive, send)
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        started = False

        async def tracked_send(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, replay, tracked_send)
        except Exception:  # noqa: BLE001 - answered here, logged with its traceback
            request_id = secrets.token_hex(8)
            logger.exception("internal error serving %s %s (request id %s)", scope["method"],
                             scope["path"], request_id)
            if not started:
                await error_response(500, f"internal server error (request id {request_id})",
                                     code="internal_error",
                                     headers={"x-request-id": request_id})(scope, replay, send)

    async def _too_large(self, scope, receive, send):
        await error_response(413, f"the request body exceeds max_request_bytes "
                             f"({self.max_request_bytes})", code="request_too_large")(
            scope, receive, send)
