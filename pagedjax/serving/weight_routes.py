"""Training to serving over HTTP (issue 52; vLLM's and SGLang's RL endpoints), behind the admin
key as /admin/* is (absent without one), in process or with the engine core process:

    POST /update_weights       {"path": a checkpoint (orbax, HF directory, GGUF), "version":
                               its name, "mode": "wait" | "abort" | "keep", "timeout_s"}
    POST /pause                {"mode", "timeout_s"}       POST /resume
    POST /reset_prefix_cache   409 while requests hold blocks
    POST /sleep {"level"}      POST /wake_up {"tags"}   (GET /is_sleeping: the flag; asleep, a
                               request is refused by name, 400)
    GET  /weight_info          {"weight_version", "is_paused", "is_sleeping"}
                               (GET /is_paused: the flag)

`wait` drains here, not on the engine thread: new requests are held (they queue), the requests in
flight go on streaming to the end, then the update (or the pause) applies; past timeout_s the
hold is released and the answer is 504, nothing changed. One update runs at a time: another sent
meanwhile is refused (409 update_in_progress), so each 200 names the version it put in place. The weights are read on the engine's
side between two steps (the core process reads them itself).
"""

from __future__ import annotations

import asyncio
from typing import Literal

import fastapi
from pydantic import BaseModel, ConfigDict, Field

from pagedjax.serving.admin import admin_only
from pagedjax.serving.http_common import APIError, error_response, get_route, parse_body
from pagedjax.serving.server_state import ServerState

PATHS = ("/update_weights", "/pause", "/resume", "/reset_prefix_cache", "/weight_info",
         "/is_paused", "/sleep", "/wake_up", "/is_sleeping")
POLL_S = 0.02


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["wait", "abort", "keep"] = "wait"
    timeout_s: float = Field(600.0, gt=0, le=86_400)


class SleepRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    level: Literal[1, 2] = 1


class WakeUpRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tags: list[Literal["weights", "kv_cache"]] | None = None


class UpdateWeightsRequest(PauseRequest):
    path: str = Field(..., min_length=1, max_length=4096)
    version: str | None = Field(None, min_length=1, max_length=256)


async def _drain(frontend, timeout_s: float) -> None:
    """Holds new requests until those in flight are done (APIError 504 past timeout_s, the hold
    released)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    await frontend.control("hold_new")
    while await frontend.control("in_flight"):
        if loop.time() > deadline:
            await frontend.control("release_new")
            raise APIError(504, f"requests were still in flight after timeout_s ({timeout_s} "
                                f"s); nothing changed")
        await asyncio.sleep(POLL_S)


def weight_routes(server: ServerState, app: fastapi.FastAPI) -> None:
    async def control(name: str, **kwargs):
        try:
            return await server.async_engine.control(name, **kwargs)
        except ValueError as error:  # a bad checkpoint or weights: named by the engine
            raise APIError(400, str(error)[:2000], "path" if "path" in kwargs else None) from None

    _update_routes(server, app, control)
    _sleep_routes(server, app, control)


def _update_routes(server: ServerState, app: fastapi.FastAPI, control) -> None:
    updating: list = []  # the update in progress (one at a time: the caller learns which version won)

    async def update_weights(request: fastapi.Request):
        body = parse_body(await request.body(), UpdateWeightsRequest)
        if updating:
            raise APIError(409, "an update_weights is in progress; send this one once it has "
                                "answered", None, code="update_in_progress")
        updating.append(body)
        try:
            return {"weight_version": await _update(body)}
        finally:
            updating.clear()

    async def _update(body: UpdateWeightsRequest) -> str:
        mode = body.mode
        if mode == "wait":
            await _drain(server.async_engine, body.timeout_s)
            mode = "keep"  # nothing in flight any more
        try:
            return await control("update_weights", path=body.path, version=body.version,
                                 mode=mode)
        finally:
            if body.mode == "wait":
                await server.async_engine.control("release_new")

    async def pause(request: fastapi.Request):
        body = parse_body(await request.body() or b"{}", PauseRequest)
        if body.mode == "wait":
            await _drain(server.async_engine, body.timeout_s)
        await control("pause", mode="keep" if body.mode == "wait" else body.mode)
        return await control("weight_info")

    async def resume(request: fastapi.Request):
        await control("resume")
        return await control("weight_info")

    async def reset_prefix_cache(request: fastapi.Request):
        if not await control("reset_prefix_cache"):
            return error_response(409, "requests hold KV blocks: the prefix cache resets once "
                                  "they end", None)
        return {"reset": True}

    async def weight_info(request: fastapi.Request):
        return await control("weight_info")

    async def is_paused(request: fastapi.Request):
        return {"is_paused": (await control("weight_info"))["is_paused"]}

    app.post("/update_weights")(admin_only(server, update_weights))
    app.post("/pause")(admin_only(server, pause))
    app.post("/resume")(admin_only(server, resume))
    app.post("/reset_prefix_cache")(admin_only(server, reset_prefix_cache))
    get_route(app, "/weight_info")(admin_only(server, weight_info))
    get_route(app, "/is_paused")(admin_only(server, is_paused))


def _sleep_routes(server: ServerState, app: fastapi.FastAPI, control) -> None:
    async def sleep(request: fastapi.Request):
        body = parse_body(await request.body() or b"{}", SleepRequest)
        await control("sleep", level=body.level)
        return await control("weight_info")

    async def wake_up(request: fastapi.Request):
        body = parse_body(await request.body() or b"{}", WakeUpRequest)
        await control("wake_up", tags=body.tags)
        return await control("weight_info")

    async def is_sleeping(request: fastapi.Request):
        return {"is_sleeping": (await control("weight_info"))["is_sleeping"]}

    app.post("/sleep")(admin_only(server, sleep))
    app.post("/wake_up")(admin_only(server, wake_up))
    get_route(app, "/is_sleeping")(admin_only(server, is_sleeping))
