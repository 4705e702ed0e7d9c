"""KV-aware routing across pagedjax server instances: an OpenAI-compatible proxy that sends each
request to the instance most likely to hold its prompt's prefix in its prefix cache, unless the
instances' loads are out of balance.

    pagedjax router --backend http://10.0.0.1:8000 --backend http://10.0.0.2:8000 --port 8080

The router cannot see the instances' block hashes, so it keeps its own approximate picture, as
SGLang's cache-aware router does: for each instance, the chained hashes of the prompt chunks it
has sent there (64 characters of text, or 16 token ids, a chunk: about one KV block), in an LRU
of bounded size. A request's match on an instance is the number of its leading chunks found
there. Policy `kv_aware` (the default):

1. if the loads (requests in flight through this router) are out of balance (max - min >
   balance_abs and max > balance_rel * min), the least loaded instance;
2. else the instance with the longest match, when that match covers at least min_match of the
   prompt's chunks (ties: least loaded);
3. else the least loaded, ties broken by the smallest index (the most room for a new prefix),
   then in turn.

`round_robin` and `least_loaded` are there to compare against. A request whose instance cannot
be reached before any byte was returned is sent to the next one, and that instance is skipped
for `retry_after_s`; errors an instance answers (HTTP 4xx/5xx) pass through unchanged.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import time
from typing import Any, Sequence

import fastapi
import httpx
import prometheus_client as prom
from fastapi import responses

POLICIES = ("kv_aware", "round_robin", "least_loaded")


@dataclasses.dataclass
class Backend:
    url: str
    in_flight: int = 0
    down_until: float = 0.0
    index: collections.OrderedDict = dataclasses.field(default_factory=collections.OrderedDict)

    def alive(self, now: float) -> bool:
        return now >= self.down_until


def prompt_chunks(prompt: str | Sequence[int], text_chunk: int = 64,
                  ids_chunk: int = 16) -> list[int]:
    """Chained hashes of a prompt's whole chunks (a chunk's hash covers everything before it,
    so equal hashes mean equal prefixes)."""
    if isinstance(prompt, str):
        size, items = text_chunk, prompt
    else:
        size, items = ids_chunk, tuple(prompt)
    hashes, parent = [], 0
    for start in range(0, len(items) - size + 1, size):
        parent = hash((parent, items[start:start + size]))
        hashes.append(parent)
    return hashes


def routing_key(path: str, body: dict) -> str | list[int] | None:
    """What a request's prefix is: the completion prompt (the first, for a batch), or the
    conversation rendered role by role (a conversation's earlier turns are a prefix of it)."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<|{m.get('role')}|>{content or ''}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list)
                                   and all(isinstance(t, int) for t in prompt)):
        return prompt
    return None


class RoutingPolicy:
    """Picks a backend for a prompt's chunk hashes; pure bookkeeping, no I/O."""

    def __init__(self, backends: Sequence[Backend], policy: str = "kv_aware", *,
                 balance_abs: int = 8, balance_rel: float = 1.5, min_match: float = 0.25,
                 index_capacity: int = 100_000):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if not backends:
            raise ValueError("at least one backend is needed")
        if balance_abs < 0 or balance_rel < 1:
            raise ValueError(f"balance_abs must be >= 0 and balance_rel >= 1, got "
                             f"{balance_abs}, {balance_rel}")
        if not 0 <= min_match <= 1:
            raise ValueError(f"min_match must be in [0, 1], got {min_match}")
        if index_capacity < 1:
            raise ValueError(f"index_capacity must be >= 1, got {index_capacity}")
        self.backends = list(backends)
        self.policy = policy
        self.balance_abs, self.balance_rel = balance_abs, balance_rel
        self.min_match = min_match
        self.index_capacity = index_capacity
        self._turn = 0

    @staticmethod
    def match(backend: Backend, chunks: Sequence[int]) -> int:
        n = 0
        for h in chunks:
            if h not in backend.index:
                break
            n += 1
        return n

    def _next_turn(self, candidates: list[Backend]) -> Backend:
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    def choose(self, chunks: Sequence[int], exclude: Sequence[Backend] = (),
               now: float | None = None) -> tuple[Backend, int]:
        """(backend, matched chunks); raises LookupError when no backend is alive."""
        now = time.monotonic() if now is None else now
        alive = [b for b in self.backends if b.alive(now) and b not in exclude]
        if not alive:
            raise LookupError("no backend is reachable")
        if self.policy == "round_robin":
            backend = self._next_turn(alive)
            return backend, self.match(backend, chunks)
        loads = [b.in_flight for b in alive]
        least = min(loads)
        least_loaded = [b for b in alive if b.in_flight == least]
        if self.policy == "kv_aware":
            imbalanced = (max(loads) - least > self.balance_abs
                          and max(loads) > self.balance_rel * least)
            if not imbalanced and chunks:
                matches = [self.match(b, chunks) for b in alive]
                best = max(matches)
                if best > 0 and best >= self.min_match * len(chunks):
                    tied = [b for b, m in zip(alive, matches) if m == best]
                    backend = min(tied, key=lambda b: b.in_flight)
                    return backend, best
            smallest = min(len(b.index) for b in least_loaded)
            least_loaded = [b for b in least_loaded if len(b.index) == smallest]
        backend = self._next_turn(least_loaded)
        return backend, self.match(backend, chunks)

    def record(self, backend: Backend, chunks: Sequence[int]) -> None:
        """The backend now holds (or will) these chunks: most recently used last."""
        index = backend.index
        for h in chunks:
            index[h] = None
            index.move_to_end(h)
        while len(index) > self.index_capacity:
            index.popitem(last=False)


class Router:
    def __init__(self, urls: Sequence[str], policy: str = "kv_aware", *,
                 retry_after_s: float = 5.0, timeout_s: float = 600.0, **policy_kwargs):
        urls = [u.rstrip("/") for u in urls]
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"backend must be an http(s):// URL, got {url!r}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"backends must be distinct, got {urls}")
        self.backends = [Backend(u) for u in urls]
        self.policy = RoutingPolicy(self.backends, policy, **policy_kwargs)
        self.retry_after_s = retry_after_s
        self.timeout_s = timeout_s
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
        self.in_flight = prom.Gauge("pagedjax_router:in_flight", "Requests in flight, by "
                                    "backend.", ["backend"], registry=self.registry)
        self.client: httpx.AsyncClient | None = None

    async def forward(self, path: str, request: fastapi.Request):
        raw = await request.body()
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as e:
            return _error(400, f"body is not valid JSON: {e}", None)
        if not isinstance(body, dict):
            return _error(400, "body must be a JSON object", None)
        key = routing_key(path, body)
        chunks = prompt_chunks(key) if key is not None else []
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        tried: list[Backend] = []
        while True:
            try:
                backend, matched = self.policy.choose(chunks, exclude=tried)
            except LookupError:
                return _error(503, "no backend is reachable", None, "server_error",
                              "no_backend")
            tried.append(backend)
            backend.in_flight += 1
            self.in_flight.labels(backend.url).set(backend.in_flight)
            upstream = self.client.build_request("POST", backend.url + path, content=raw,
                                                 headers=headers)
            try:
                response = await self.client.send(upstream, stream=True)
            except httpx.TransportError:
                self._release(backend)
                backend.down_until = time.monotonic() + self.retry_after_s
                self.failovers.labels(backend.url).inc()
                continue
            except BaseException:  # cancelled: the client went away while we waited
                self._release(backend)
                raise
            break
        self.policy.record(backend, chunks)
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

    def _release(self, backend: Backend) -> None:
        backend.in_flight -= 1
        self.in_flight.labels(backend.url).set(backend.in_flight)

    async def _probe(self, backend: Backend) -> bool:
        try:
            response = await self.client.get(backend.url + "/health", timeout=5)
            return response.status_code == 200
        except httpx.TransportError:
            return False

    def build_app(self) -> fastapi.FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self.client = httpx.AsyncClient(timeout=self.timeout_s, limits=limits)
            try:
                yield
            finally:
                await self.client.aclose()

        app = fastapi.FastAPI(title="pagedjax router", lifespan=lifespan)

        @app.post("/v1/completions")
        async def completions(request: fastapi.Request):
            return await self.forward("/v1/completions", request)

        @app.post("/v1/chat/completions")
        async def chat_completions(request: fastapi.Request):
            return await self.forward("/v1/chat/completions", request)

        @app.get("/v1/models")
        async def models(request: fastapi.Request):
            headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
            for backend in self.backends:
                with contextlib.suppress(httpx.TransportError):
                    response = await self.client.get(backend.url + "/v1/models",
                                                     headers=headers, timeout=10)
                    return responses.JSONResponse(response.json(),
                                                  status_code=response.status_code)
            return _error(503, "no backend is reachable", None, "server_error", "no_backend")

        @app.get("/health")
        async def health():
            states = await asyncio.gather(*(self._probe(b) for b in self.backends))
            body = {"backends": {b.url: ok for b, ok in zip(self.backends, states)}}
            return responses.JSONResponse(body, status_code=200 if any(states) else 503)

        @app.get("/metrics")
        async def metrics():
            return responses.Response(prom.generate_latest(self.registry),
                                       media_type="text/plain; version=0.0.4; charset=utf-8")

        return app


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
    return responses.JSONResponse(
        {"error": {"message": message, "type": type_, "param": param, "code": code}},
        status_code=status)


def run_router(urls: Sequence[str], policy: str = "kv_aware", *, host: str = "127.0.0.1",
               port: int = 8080, log_level: str = "info", **policy_kwargs) -> None:
    import uvicorn

    app = Router(urls, policy, **policy_kwargs).build_app()
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.run(app, host=host, port=port, log_level=log_level)
