"""POST /v1/responses (OpenAI's Responses API, as vLLM serves it), GET / DELETE
/v1/responses/{id} and POST /v1/responses/{id}/cancel.

A request runs as the chat request pagedjax.serving.responses_input makes of it (the same
template, tools, reasoning and structured outputs); its reply comes back as output items, whole
or as the Responses event stream. Responses are kept in the server's ResponseStore (unless
`store: false`) for GET and for a follow-up's `previous_response_id`; with the store off
(`--responses-store-size 0`), `store: true`, `previous_response_id` and `background` are
refused by name. `background: true` answers at once with status "queued"; the reply is polled
with GET and can be cancelled until it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time

import fastapi

from pagedjax.engine.delta_outputs import CumulativeOutput
from pagedjax.frontend.async_engine import EngineDeadError, RequestFailedError
from pagedjax.serving import chat, responses_output as output
from pagedjax.serving.http_common import APIError, get_route, parse_body
from pagedjax.serving.request_params import ParamNames
from pagedjax.serving.responses_input import PARAM_NAMES, ResponsesRequest, chat_request
from pagedjax.serving.server_state import ServerState

logger = logging.getLogger("pagedjax.responses")
PARAMS_OF: ParamNames = {"prompt_token_ids": "input", "prompts": "input",
                         "max_tokens": "max_output_tokens"}


def _renamed(error: APIError) -> APIError:
    """A chat request's error under the Responses request's field names."""
    if error.param is None:
        return error
    param = PARAM_NAMES.get(error.param, error.param)
    message = error.message
    if error.param in PARAM_NAMES and message.startswith(error.param):
        message = param + message[len(error.param):]
    error.param, error.message = param, message
    return error


class _Run:
    """One Responses request on its way: the body, its chat run, what the response says."""

    def __init__(self, server: ServerState, body: ResponsesRequest, response_id: str,
                 keep: bool):
        self.server, self.body, self.id, self.keep = server, body, response_id, keep
        self.created = int(time.time())
        self.conversation: list[dict] = []
        self.chat: chat.ChatRun | None = None

    @property
    def started(self) -> chat.ChatRun:
        """The chat run, once the request was queued."""
        if self.chat is None:
            raise RuntimeError(f"{self.id}: its chat run has not started")
        return self.chat

    def response(self, status: str, items: list[dict], usage: dict | None = None,
                 incomplete: dict | None = None, error: dict | None = None) -> dict:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.server.reply_model(body.model), "output": items, "usage": usage, "error": error,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "store": self.keep,
            "background": body.background, "text": body.text or {"format": {"type": "text"}},
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "truncation": "disabled", "metadata": body.metadata or {}, "user": body.user,
            "service_tier": "default"}

    def finished(self, out, items: list[dict]) -> dict:
        """The response of a finished reply; stored when kept."""
        choice = out.outputs[0]
        status, incomplete = output.status_of(choice.finish_reason)
        error = None
        if choice.finish_reason == "error":
            status, error = "failed", {"code": "server_error", "message": out.error or "failed"}
        reasoning = "".join(c["text"] for i in items if i["type"] == "reasoning"
                            for c in i["content"])
        tokenizer = self.server.tokenizer
        usage = {"input_tokens": len(out.prompt_token_ids),
                 "input_tokens_details": {"cached_tokens": out.metrics.num_cached_tokens},
                 "output_tokens": choice.num_tokens,
                 "output_tokens_details": {"reasoning_tokens": len(tokenizer.encode(
                     reasoning, add_special_tokens=False)) if reasoning else 0},
                 "total_tokens": len(out.prompt_token_ids) + choice.num_tokens}
        response = self.response(status, items, usage, incomplete, error)
        if self.keep:
            self.server.responses.put(self.id, response, self.conversation
                                      + [output.assistant_turn(items)])
        return response


async def create(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), ResponsesRequest)
    server.check_model_name(body.model)
    store = server.responses
    for field, wanted in (("store", body.store), ("previous_response_id",
                                                  body.previous_response_id),
                          ("background", body.background)):
        if wanted and not store.enabled:
            raise APIError(400, f"{field}: this server keeps no responses (started with "
                           f"--responses-store-size 0)", field)
    if body.background and (body.store is False or body.stream):
        raise APIError(400, "background needs store (not false) and no stream", "background")
    history = []
    if body.previous_response_id is not None:
        entry = store.get(body.previous_response_id)
        if entry is None:
            raise APIError(400, "previous_response_id: no stored response has that id (never "
                           "stored, expired or deleted)", "previous_response_id")
        history = entry.messages
    run = _Run(server, body, output.new_id("resp"), store.enabled and body.store is not False)
    try:
        chat_body, run.conversation = chat_request(body, history)
        run.chat = await chat.start(server, chat_body, request, run.id, dict(PARAMS_OF))
    except APIError as e:
        raise _renamed(e) from None
    if body.background:
        return _background(run)
    if body.stream:
        return server.stream(_events(run), run.started.capped)
    final = await server.collect(run.started.group, request)
    if final is None:
        return server.gone()
    out = final[run.id]
    message, _ = run.started.reader.message(out.outputs[0].text or "", out.outputs[0].finish_reason)
    return server.respond(run.finished(out, output.output_items(message)), run.started.capped)


async def _events(run: _Run):
    stream, reply = output.EventStream(), run.started.reader.stream()
    yield stream.event("response.created", response=run.response("in_progress", []))
    yield stream.event("response.in_progress", response=run.response("in_progress", []))
    final, text = None, ""  # the outputs are DELTA ones: the text so far is their sum
    try:
        async with run.started.group:
            async for out in run.started.group:
                choice = out.outputs[0]
                text += choice.text or ""
                for delta in reply.feed(text, choice.finish_reason is not None):
                    for event in stream.feed(delta):
                        yield event
                final = out if out.finished else final
    except (EngineDeadError, RequestFailedError) as e:
        for event in stream.close():
            yield event
        yield stream.event("response.failed", response=run.response(
            "failed", stream.items, error={"code": "server_error", "message": str(e)[:500]}))
        return
    for event in stream.close():
        yield event
    response = run.finished(final, stream.items)
    kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
        response["status"], "response.failed")
    yield stream.event(kind, response=response)


def _background(run: _Run):
    server = run.server
    queued = run.response("queued", [])
    server.responses.put(run.id, queued, run.conversation, running=True)

    async def finish():
        try:
            async with run.started.group:
                final, merged = None, CumulativeOutput()
                async for out in run.started.group:
                    merged.add(out)
                    final = merged.output() if out.finished else final
                    if final is None:
                        server.responses.update(run.id, run.response("in_progress", []))
            choice = final.outputs[0]
            message, _ = run.started.reader.message(choice.text or "", choice.finish_reason)
            run.finished(final, output.output_items(message))
        except asyncio.CancelledError:
            server.responses.update(run.id, run.response("cancelled", []), running=False)
        except Exception as e:  # noqa: BLE001 - the response says it failed
            logger.warning("background response %s failed: %s", run.id, e)
            server.responses.update(run.id, run.response("failed", [], error={
                "code": "server_error", "message": str(e)[:500]}), running=False)
        finally:
            server.background_responses.pop(run.id, None)

    server.background_responses[run.id] = asyncio.ensure_future(finish())
    return queued


def _stored(server: ServerState, response_id: str):
    entry = server.responses.get(response_id)
    if entry is None:
        raise APIError(404, "no stored response has that id (never stored, expired or "
                       "deleted)", "response_id", code="response_not_found")
    return entry


async def retrieve(server: ServerState, response_id: str):
    return _stored(server, response_id).response


async def delete(server: ServerState, response_id: str):
    _stored(server, response_id)
    task = server.background_responses.get(response_id)
    if task is not None:
        task.cancel()
    server.responses.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


async def cancel(server: ServerState, response_id: str):
    entry = _stored(server, response_id)
    task = server.background_responses.get(response_id)
    if not entry.response.get("background"):
        raise APIError(400, "only background responses can be cancelled", "response_id")
    if task is not None:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return _stored(server, response_id).response


def responses_routes(server: ServerState, app: fastapi.FastAPI) -> None:
    async def create_route(request: fastapi.Request):
        return await create(server, request)

    async def retrieve_route(response_id: str):
        return await retrieve(server, response_id)

    async def delete_route(response_id: str):
        return await delete(server, response_id)

    async def cancel_route(response_id: str):
        return await cancel(server, response_id)

    app.post("/v1/responses")(create_route)
    get_route(app, "/v1/responses/{response_id}")(retrieve_route)
    app.delete("/v1/responses/{response_id}")(delete_route)
    app.post("/v1/responses/{response_id}/cancel")(cancel_route)
