"""KV-aware routing across pagedjax server instances: an OpenAI-compatible proxy that sends each
request to the instance most likely to hold its prompt's prefix in its prefix cache, unless the
instances' loads are out of balance.

    pagedjax router --backend http://10.0.0.1:8000 --backend http://10.0.0.2:8000 --port 8080

Placement is pagedjax.parallel.routing_policy's prefix-affinity rule (`kv_aware` by default: the
longest cached-prefix match unless loads are out of balance; the router's picture of each
instance is the chunk hashes of the prompts it sent there: 64 characters of text, or 16 token
ids, a chunk). A request whose instance cannot be reached before any byte was returned is sent
to the next one, and that instance is skipped for `retry_after_s`; errors a stable instance answers (HTTP 4xx/5xx) pass through unchanged.

Long-context requests (a prompt over `--long-context-threshold` tokens; text estimated at 4
characters a token) go to `--long-context-backend URL` instances of their own, so that their
prefill does not stall the short requests' decoding; the stable group takes them when none of
those is reachable.

Safe rollout: `--canary URL` instances (a new model, config or build) get `--canary-weight` of
the traffic; a RolloutGuard compares their error rate and median latency with the stable
group's over a sliding window and rolls the canary back by itself when it is worse by more than
the limits. A canary that fails a request (5xx, unreachable) has it resent to the stable group,
so clients do not see the canary's failures. `GET /router/status`, `POST /router/canary
{"weight": w}` (ramp up, or re-arm after a rollback), `POST /router/rollback` and `POST
/router/promote` (the canary becomes the stable group) drive it, behind `--admin-key`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Sequence

import fastapi
import httpx
import prometheus_client as prom
from fastapi import responses

from pagedjax.parallel.routing_policy import POLICIES, Backend, RoutingPolicy, prompt_chunks
from pagedjax.serving.http_common import (DEFAULT_MAX_REQUEST_BYTES, GuardMiddleware,
                                          error_response, get_route, install_error_handlers,
                                          key_matches, parse_json_object)
from pagedjax.serving.rollout import RolloutGuard
from pagedjax.serving.routing_keys import prompt_tokens, request_model, routing_key

__all__ = ["POLICIES", "Backend", "RolloutGuard", "Router", "RoutingPolicy", "prompt_chunks",
           "prompt_tokens", "routing_key", "run_router"]


def _urls(group: str, values: Sequence[str]) -> list[str]:
    """A group's backend URLs without a trailing slash; ValueError for one that is not
    http(s)."""
    values = [u.rstrip("/") for u in values]
    for url in values:
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"{group} must be an http(s):// URL, got {url!r}")
    return values


class Router:
    """The proxy: a stable group of instances and, optionally, a canary group getting a share
    of the traffic under a RolloutGuard. A canary's failure is never the client's: a canary
    that cannot be reached or answers 5xx has the request resent to the stable group."""

    def __init__(self, urls: Sequence[str], policy: str = "kv_aware", *,
                 canary: Sequence[str] = (), canary_weight: float = 0.0,
                 guard: dict | None = None, admin_key: str | None = None,
                 long_context: Sequence[str] = (), long_context_threshold: int = 4096,
                 retry_after_s: float = 5.0, timeout_s: float = 600.0,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, **policy_kwargs):
        """admin_key: the /router/* admin endpoints exist only with one (and need it).
        long_context: instances of their own for prompts over long_context_threshold tokens
        (estimated for text, see prompt_tokens); they take no other traffic."""
        urls, canary = _urls("backend", urls), _urls("canary", canary)
        long_context = _urls("long_context", long_context)
        everyone = urls + canary + long_context
        if len(set(everyone)) != len(everyone):
            raise ValueError(f"backends must be distinct, got {everyone}")
        if isinstance(long_context_threshold, bool) or not isinstance(
                long_context_threshold, int) or long_context_threshold < 1:
            raise ValueError(f"long_context_threshold must be an integer >= 1, got "
                             f"{long_context_threshold!r}")
        self.long_context_threshold = long_context_threshold
        if canary_weight and not canary:
            raise ValueError("canary_weight needs canary backends")
        self.policy_name = policy
        self.policy_kwargs = policy_kwargs
        self.groups = {"stable": RoutingPolicy([Backend(u) for u in urls], policy,
                                               **policy_kwargs)}
        for name, group in (("canary", canary), ("long_context", long_context)):
            if group:
                self.groups[name] = RoutingPolicy([Backend(u) for u in group], policy,
                                                  **policy_kwargs)
        self.guard = RolloutGuard(canary_weight, **(guard or {}))
        if admin_key is not None and (not isinstance(admin_key, str) or not admin_key):
            raise ValueError("admin_key must be None or a non-empty string")
        self.admin_key = admin_key
        self.max_request_bytes = max_request_bytes
        self.retry_after_s = retry_after_s
        self.timeout_s = timeout_s
        self._init_metrics()
        self.client: httpx.AsyncClient | None = None

    def _init_metrics(self) -> None:
        """The router's Prometheus series, in a registry of its own."""
        self.registry = prom.CollectorRegistry()
        self.routed = prom.Counter("pagedjax_router:requests", "Requests sent, by backend.",
                                   ["backend"], registry=self.registry)
        self.prompt_chunks = prom.Counter("pagedjax_router:prompt_chunks",
                                          "Prompt chunks of routed requests.",
                                          registry=self.registry)
        self.matched_chunks = prom.Counter(
            "pagedjax_router:matched_chunks",
            "Prompt chunks already sent to the chosen backend (expected prefix-cache hits).",
            registry=self.registry)
        self.failovers = prom.Counter("pagedjax_router:failovers",
                                      "Requests resent because a backend was unreachable.",
                                      ["backend"], registry=self.registry)
        self.outcomes = prom.Counter("pagedjax_router:responses",
                                     "Responses by group and outcome (error: 5xx or "
                                     "unreachable).", ["group", "outcome"],
                                     registry=self.registry)
        self.canary_retries = prom.Counter(
            "pagedjax_router:canary_retries",
            "Requests a canary failed and the stable group then served.", registry=self.registry)
        self.canary_weight = prom.Gauge("pagedjax_router:canary_weight",
                                        "The canary group's share of the traffic.",
                                        registry=self.registry)
        self.canary_weight.set_function(lambda: self.guard.weight)
        self.in_flight = prom.Gauge("pagedjax_router:in_flight", "Requests in flight, by "
                                    "backend.", ["backend"], registry=self.registry)

    @property
    def backends(self) -> list[Backend]:
        return [b for group in self.groups.values() for b in group.backends]

    def _record(self, group: str, ok: bool, latency_s: float | None) -> None:
        if group in ("stable", "canary"):  # what the rollout guard compares
            self.guard.record(group, ok, latency_s)
        self.outcomes.labels(group, "ok" if ok else "error").inc()

    def _group(self, key) -> str:
        """Where a request goes first: the long-context group for a long prompt, else the
        canary group for its share of the rest, else the stable group."""
        if "long_context" in self.groups and key is not None and \
                prompt_tokens(key) > self.long_context_threshold:
            return "long_context"
        return "canary" if "canary" in self.groups and self.guard.to_canary() else "stable"

    async def forward(self, path: str, request: fastapi.Request):
        raw = await request.body()
        body = parse_json_object(raw)
        key = routing_key(path, body)
        chunks = prompt_chunks(key, model=request_model(body)) if key is not None else []
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        group = self._group(key)
        tried: list[Backend] = []
        while True:
            try:
                backend, matched = self.groups[group].choose(chunks, exclude=tried)
            except LookupError:  # the group has no reachable instance left
                if group != "stable":
                    group = "stable"
                    continue
                return _error(503, "no backend is reachable", None, "server_error",
                              "no_backend")
            tried.append(backend)
            backend.in_flight += 1
            self.in_flight.labels(backend.url).set(backend.in_flight)
            upstream = self.http.build_request("POST", backend.url + path, content=raw,
                                                 headers=headers)
            start = time.monotonic()
            try:
                response = await self.http.send(upstream, stream=True)
            except httpx.TransportError:
                self._release(backend)
                backend.down_until = time.monotonic() + self.retry_after_s
                self.failovers.labels(backend.url).inc()
                self._record(group, False, None)
                if group == "canary":
                    group = "stable"
                continue
            except BaseException:  # cancelled: the client went away while we waited
                self._release(backend)
                raise
            ok = response.status_code < 500
            self._record(group, ok, time.monotonic() - start if ok else None)
            if not ok and group == "canary":
                await response.aclose()
                self._release(backend)
                self.canary_retries.inc()
                group = "stable"
                continue
            break
        self.groups[group].record(backend, chunks)
        self.routed.labels(backend.url).inc()
        self.prompt_chunks.inc(len(chunks))
        self.matched_chunks.inc(matched)

        async def close():
            await response.aclose()
            self._release(backend)

        passed = {k: v for k, v in response.headers.items()
                  if k.lower() in ("content-type", "retry-after")}
        passed["x-pagedjax-backend"] = backend.url
        return _Relay(response.aiter_raw(), close, status_code=response.status_code,
                      headers=passed)

    # ---- rollout -------------------------------------------------------------------------------

    def status(self) -> dict:
        now = time.monotonic()
        return {"policy": self.policy_name,
                "backends": [{"url": b.url, "group": g, "in_flight": b.in_flight,
                              "reachable": b.alive(now), "indexed_chunks": len(b.index)}
                             for g, policy in self.groups.items() for b in policy.backends],
                "canary": self.guard.status()}

    def set_canary_weight(self, weight: float) -> None:
        if "canary" not in self.groups:
            raise ValueError("there is no canary group (start the router with --canary URL)")
        self.guard.set_weight(weight)

    def promote(self) -> None:
        """The canary group becomes the stable one (the old stable instances get no new
        requests; those in flight finish)."""
        if "canary" not in self.groups:
            raise ValueError("there is no canary group to promote")
        self.groups = {**{name: g for name, g in self.groups.items()
                          if name not in ("stable", "canary")}, "stable": self.groups["canary"]}
        self.guard.set_weight(0.0)
        self.guard.outcomes["stable"].clear()

    def _release(self, backend: Backend) -> None:
        backend.in_flight -= 1
        self.in_flight.labels(backend.url).set(backend.in_flight)

    async def _probe(self, backend: Backend) -> bool:
        try:
            response = await self.http.get(backend.url + "/health", timeout=5)
            return response.status_code == 200
        except httpx.TransportError:
            return False

    @property
    def http(self) -> httpx.AsyncClient:
        """The backends' HTTP client, which the app's lifespan opens and closes."""
        if self.client is None:
            raise RuntimeError("the router's app is not running (its lifespan opens the client)")
        return self.client

    def build_app(self) -> fastapi.FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self.client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
            try:
                yield
            finally:
                await self.http.aclose()

        app = fastapi.FastAPI(title="pagedjax router", lifespan=lifespan)
        install_error_handlers(app)
        app.add_middleware(GuardMiddleware, max_request_bytes=self.max_request_bytes)

        @app.post("/v1/completions")
        async def completions(request: fastapi.Request):
            return await self.forward("/v1/completions", request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: fastapi.Request):
            return await self.forward("/v1/chat/completions", request)

        @get_route(app, "/v1/models")
        async def models(request: fastapi.Request):
            headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
            for backend in self.backends:
                with contextlib.suppress(httpx.TransportError):
                    response = await self.http.get(backend.url + "/v1/models",
                                                     headers=headers, timeout=10)
                    return responses.JSONResponse(response.json(),
                                                  status_code=response.status_code)
            return _error(503, "no backend is reachable", None, "server_error", "no_backend")

        if self.admin_key is not None:
            self._admin_routes(app)

        @get_route(app, "/health")
        async def health():
            states = await asyncio.gather(*(self._probe(b) for b in self.backends))
            body = {"backends": {b.url: ok for b, ok in zip(self.backends, states)}}
            return responses.JSONResponse(body, status_code=200 if any(states) else 503)

        @get_route(app, "/metrics")
        async def metrics():
            return responses.Response(prom.generate_latest(self.registry),
                                       media_type="text/plain; version=0.0.4; charset=utf-8")

        return app


    def _admin_routes(self, app: fastapi.FastAPI) -> None:
        """GET /router/status, POST /router/canary {"weight": w}, /router/rollback and
        /router/promote, each behind the admin key (compared in constant time)."""
        key = self.admin_key
        if key is None:
            return

        def admin(handler):
            async def guarded(request: fastapi.Request):
                if not key_matches(request.headers.get("authorization"), key):
                    return _error(401, "missing or wrong admin key (Authorization: Bearer ...)",
                                  None, "authentication_error", "invalid_api_key")
                return await handler(request)
            return guarded

        async def router_status(request):
            return self.status()

        async def router_canary(request):
            body = parse_json_object(await request.body())
            weight = body.get("weight")
            if set(body) != {"weight"} or isinstance(weight, bool) or not isinstance(
                    weight, (int, float)):
                return _error(400, 'the body must be {"weight": w} with w in [0, 1]', "weight")
            try:
                self.set_canary_weight(float(weight))
            except ValueError as e:
                return _error(400, str(e), "weight")
            return self.status()

        async def router_rollback(request):
            self.guard.rollback("rolled back by hand (POST /router/rollback)")
            return self.status()

        async def router_promote(request):
            try:
                self.promote()
            except ValueError as e:
                return _error(400, str(e), None)
            return self.status()

        get_route(app, "/router/status")(admin(router_status))
        app.post("/router/canary")(admin(router_canary))
        app.post("/router/rollback")(admin(router_rollback))
        app.post("/router/promote")(admin(router_promote))


class _Relay(responses.StreamingResponse):
    """Streams an instance's response through; closes it and releases the instance however
    the response ends (finished, or the client gone before or while streaming)."""

    def __init__(self, content, on_close, **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def _error(status: int, message: str, param: str | None, type_: str = "invalid_request_error",
           code: Any = None) -> responses.JSONResponse:
    return error_response(status, message, param, type_, code)


def run_router(urls: Sequence[str], policy: str = "kv_aware", *, host: str = "127.0.0.1",
               port: int = 8080, log_level: str = "info", **router_kwargs) -> None:
    import uvicorn

    app = Router(urls, policy, **router_kwargs).build_app()
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(app, host=host, port=port, log_level=log_level)
