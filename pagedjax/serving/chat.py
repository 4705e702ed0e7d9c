"""POST /v1/chat/completions: messages rendered with the chat template, one reply per choice,
whole or streamed."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time

import fastapi

from pagedjax.engine.outputs import CompletionOutput, RequestOutput
from pagedjax.frontend.async_engine import PromptSpec, RequestGroup
from pagedjax.serving import tool_calls
from pagedjax.serving.chat_replies import ReplyReader
from pagedjax.serving.http_common import APIError, parse_body
from pagedjax.serving.protocol import (ChatCompletionRequest, prompt_logprobs_json, usage_json,
                                       wire_logprob)
from pagedjax.serving.request_params import ParamNames
from pagedjax.serving.server_state import ServerState
from pagedjax.serving.streaming import DONE, DeltaTracker, guard, sse
from pagedjax.serving.tool_calls import ToolRequest, call_arguments
from pagedjax.text.tokenizer import NO_CHAT_TEMPLATE


def _message(i: int, message) -> dict:
    """One message as the template sees it: text parts joined, an assistant's tool-call
    arguments as objects (templates write them with tojson)."""
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages[{i}].content: only text parts "
                               "({'type': 'text', 'text': str}) are supported", "messages")
            texts.append(part["text"])
        content = "".join(texts)
    out = {**message.model_dump(exclude_none=True), "content": content or ""}
    calls = out.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict) for c in calls):
            raise APIError(400, f"messages[{i}].tool_calls must be a list of "
                           "{'function': {'name', 'arguments'}}", "messages")
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": call_arguments(
            c["function"].get("arguments"), f"messages[{i}].tool_calls[{j}].function.arguments",
            "messages")}} for j, c in enumerate(calls)]
    return out


def _continued(text: str, final: str) -> str:
    """continue_final_message: the rendering cut right after the final message's content (its
    end-of-turn dropped), as transformers does."""
    at = text.rfind(final.strip()) if final.strip() else -1
    if at < 0:
        raise APIError(400, "continue_final_message: the chat template does not write the final "
                       "message's content as it is", "continue_final_message")
    return text[:at + len(final.strip())]


def render_prompt(server: ServerState, body: ChatCompletionRequest,
                  tools: ToolRequest | None = None) -> list[int]:
    """The conversation's token ids through the server's chat template (400 without one)."""
    tokenizer = server.tokenizer
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise APIError(400, "chat needs a tokenizer with a chat template; this model has "
                       "none (use /v1/completions)", "messages")
    if server.chat_template is None:
        raise APIError(400, NO_CHAT_TEMPLATE, "messages")
    messages = [_message(i, m) for i, m in enumerate(body.messages)]
    documents = getattr(body, "documents", None)  # /tokenize's chat form has none
    effort = getattr(body, "reasoning_effort", None)
    kwargs = {"add_generation_prompt": body.add_generation_prompt, "tokenize": False,
              "chat_template": server.chat_template,
              **({"tools": list(tools.tools)} if tools is not None else {}),
              **({"reasoning_effort": effort} if effort is not None else {}),
              **(body.chat_template_kwargs or {})}
    try:
        text = tokenizer.apply_chat_template(messages, **kwargs, **(
            {"documents": documents} if documents else {}))
        if documents and text == tokenizer.apply_chat_template(messages, **kwargs):
            raise APIError(400, "documents: this model's chat template does not use documents",
                           "documents")
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input
        raise APIError(400, f"messages: the chat template failed: {str(e)[:200]}",
                       "messages") from None
    if getattr(body, "continue_final_message", False):
        text = _continued(text, messages[-1]["content"])
    return list(tokenizer.encode(text, add_special_tokens=False))


def logprobs_of(server: ServerState, choice: CompletionOutput, top_n: int) -> dict:
    """OpenAI's chat logprobs of choice's tokens: per token its logprob, bytes and top_n
    alternatives."""
    content = []
    for token_id, top in zip(choice.token_ids, choice.logprobs or []):
        text = server.token_text(token_id)
        ranked = sorted(top.items(), key=lambda kv: -kv[1].logprob)[:top_n]
        content.append({
            "token": text, "logprob": wire_logprob(top[token_id].logprob),
            "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := server.token_text(i)),
                              "logprob": wire_logprob(lp.logprob),
                              "bytes": list(t.encode())} for i, lp in ranked]})
    return {"content": content}


def _max_tokens(server: ServerState, body: ChatCompletionRequest,
                num_prompt: int) -> tuple[int, int | None]:
    """(max_tokens, the cap that cut it or None): max_completion_tokens, else max_tokens, else
    the server's default (at most what the context leaves)."""
    requested = body.max_completion_tokens
    if requested is None:
        requested = body.max_tokens
    default = max(1, server.engine.config.max_model_len - num_prompt)  # what is left
    if server.default_max_tokens is not None:
        default = min(default, server.default_max_tokens)
    return server.max_tokens(requested, default)


@dataclasses.dataclass
class ChatRun:
    """A chat request queued: what its answer is read with."""

    request_id: str
    group: RequestGroup
    reader: ReplyReader
    num_prompt: int
    capped: int | None  # the max_tokens cap that cut the request's, or None


def _prepare(server: ServerState, body: ChatCompletionRequest, params_of: ParamNames):
    """(tools, prompt ids, sampling parameters, the max_tokens cap) of a chat request: the work
    before it is queued, which a megabyte of tools, messages or prediction makes take seconds
    (start runs it off the event loop)."""
    tools = tool_calls.tool_request(body, server.tool_parser)
    ids = render_prompt(server, body, tools)
    max_tokens, capped = _max_tokens(server, body, len(ids))
    constraint = None
    if tools is not None and (schema := tools.schema()) is not None:
        constraint = ("function_call" if tools.legacy else "tool_choice", {"json": schema})
    params = server.sampling(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                             None, params_of, body.prompt_logprobs, constraint)
    return tools, ids, params, capped


async def start(server: ServerState, body: ChatCompletionRequest, request: fastapi.Request,
                request_id: str, params_of: ParamNames) -> ChatRun:
    """Renders, checks and queues a chat request (APIError naming the field otherwise); the
    rendering, tokenizing and parameters off the event loop."""
    lora = server.check_model(body)
    tools, ids, params, capped = await asyncio.to_thread(_prepare, server, body, params_of)
    reader = ReplyReader(None if tools is None or tools.choice == "none" else tools,
                         server.tool_parser, server.reasoning_parser, body.include_reasoning)
    turns = sum(m.role == "assistant" for m in body.messages)  # earlier turns in the prompt
    group = await server.add([PromptSpec(ids, params, request_id, None, body.cache_salt,
                                         lora_request=lora)],
                             params_of, body, request, turns)
    return ChatRun(request_id, group, reader, len(ids), capped)


async def chat_completions(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), ChatCompletionRequest)
    top_n = body.top_logprobs or 0
    params_of: ParamNames = {
        "prompt_token_ids": "messages", "prompts": "messages", "logprobs": "top_logprobs",
        "max_tokens": ("max_completion_tokens" if body.max_completion_tokens is not None
                       else "max_tokens")}
    run = await start(server, body, request, f"chatcmpl-{secrets.token_hex(12)}", params_of)
    request_id, group, reader, capped = run.request_id, run.group, run.reader, run.capped
    base = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": server.reply_model(body.model)}
    if body.service_tier is not None:
        base["service_tier"] = "default"

    def extra(choice: CompletionOutput) -> dict:
        """The choice's tokens' logprobs and ids, when asked for."""
        d: dict[str, object] = {}
        if body.logprobs:
            d["logprobs"] = logprobs_of(server, choice, top_n)
        if body.return_token_ids:
            d["token_ids"] = choice.token_ids
        return d

    if not body.stream:
        final = await server.collect(group, request)
        if final is None:
            return server.gone()
        out = final[request_id]
        choices = []
        for c in out.outputs:
            message, finish = reader.message(c.text or "", c.finish_reason)
            choices.append({"index": c.index, "message": message, "logprobs": None,
                            **extra(c), "finish_reason": finish, "stop_reason": c.stop_reason})
        response = {**base, "choices": choices, "usage": server.usage({request_id: out}, body.prediction is not None)}
        if body.prompt_logprobs is not None:  # vLLM: beside the choices
            response["prompt_logprobs"] = prompt_logprobs_json(
                out.prompt_logprobs, out.prompt_token_ids, body.prompt_logprobs)
        return server.respond(response, capped)
    chunk = {**base, "object": "chat.completion.chunk"}
    events = _events(server, body, group, chunk, extra, reader, run.num_prompt)
    return server.stream(guard(events), capped)


async def _events(server: ServerState, body: ChatCompletionRequest, group, chunk: dict, extra,
                  reader: ReplyReader, num_prompt: int):
    options = body.stream_options
    continuous = options is not None and options.continuous_usage_stats
    tracker = DeltaTracker(body.logprobs or body.return_token_ids or server.tokenizer is None)
    plain = reader.tools is None and reader.reasoning is None
    streams = {j: reader.stream() for j in range(body.n)}

    def event(choices: list[dict]) -> str:
        payload = {**chunk, "choices": choices}
        if continuous:  # vLLM's: the usage so far in every chunk
            payload["usage"] = usage_json(num_prompt,
                                          sum(tracker.tokens(j) for j in range(body.n)))
        return sse(payload)

    for j in range(body.n):  # one choice a chunk, as vLLM streams n > 1
        yield event([{"index": j, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}])
    final: RequestOutput | None = None
    async with group:
        async for out in group:
            choices = []
            for c in out.outputs:
                delta = tracker.advance(c.index, c)
                if delta is None:
                    continue  # nothing new a client asked for (a held-back byte)
                text = delta[0]
                finished = c.finish_reason is not None
                deltas = ([{"content": text}] if text else []) if plain else \
                    streams[c.index].feed(tracker.text(c.index), finished)
                extras = extra(c)
                if not deltas and not finished and not extras:
                    continue  # held back: maybe the start of a tag
                finish = reader.finish_reason(tracker.text(c.index), c.finish_reason) \
                    if finished else None
                choices += [{"index": c.index, "delta": d, "logprobs": None,
                             "finish_reason": None} for d in deltas or [{}]]
                choices[-1].update(extras, finish_reason=finish, stop_reason=c.stop_reason)
            final = out if out.finished else final
            for choice in choices:
                yield event([choice])
    if options is not None and options.include_usage and final is not None:
        usage = server.usage({chunk["id"]: final}, body.prediction is not None)
        yield sse({**chunk, "choices": [], "usage": usage})
    yield DONE
