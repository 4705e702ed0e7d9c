"""POST /v1/chat/completions: messages rendered with the chat template, one reply per choice,
whole or streamed."""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import TYPE_CHECKING

import fastapi

from pagedjax.engine.outputs import CompletionOutput, RequestOutput
from pagedjax.serving.async_engine import PromptSpec
from pagedjax.serving.http_common import APIError, parse_body
from pagedjax.serving.protocol import ChatCompletionRequest, prompt_logprobs_json
from pagedjax.serving.streaming import DONE, DeltaTracker, guard, sse
from pagedjax.text.tokenizer import NO_CHAT_TEMPLATE

if TYPE_CHECKING:
    from pagedjax.serving.app import OpenAIServer


def render_prompt(server: OpenAIServer, body: ChatCompletionRequest) -> list[int]:
    """The conversation's token ids through the server's chat template (400 without one)."""
    tokenizer = server.tokenizer
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise APIError(400, "chat needs a tokenizer with a chat template; this model has "
                       "none (use /v1/completions)", "messages")
    if server.chat_template is None:
        raise APIError(400, NO_CHAT_TEMPLATE, "messages")
    messages = []
    for i, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts "
                                   "({'type': 'text', 'text': str}) are supported", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        messages.append({**message.model_dump(exclude_none=True), "content": content or ""})
    documents = getattr(body, "documents", None)  # /tokenize's chat form has none
    kwargs = {"add_generation_prompt": body.add_generation_prompt, "tokenize": True,
              "chat_template": server.chat_template, **(body.chat_template_kwargs or {})}
    try:
        ids = list(tokenizer.apply_chat_template(messages, **kwargs,
                                                 **({"documents": documents}
                                                    if documents else {})))
        if documents and ids == list(tokenizer.apply_chat_template(messages, **kwargs)):
            raise APIError(400, "documents: this model's chat template does not use documents",
                           "documents")
    except APIError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error is the caller's input
        raise APIError(400, f"messages: the chat template failed: {str(e)[:200]}",
                       "messages") from None
    return ids


def logprobs_of(server: OpenAIServer, choice: CompletionOutput, start: int, top_n: int) -> dict:
    """OpenAI's chat logprobs: per token its logprob, bytes and top_n alternatives."""
    content = []
    for token_id, top in zip(choice.token_ids[start:], (choice.logprobs or [])[start:]):
        text = server.token_text(token_id)
        ranked = sorted(top.items(), key=lambda kv: -kv[1].logprob)[:top_n]
        content.append({
            "token": text, "logprob": top[token_id].logprob, "bytes": list(text.encode()),
            "top_logprobs": [{"token": (t := server.token_text(i)), "logprob": lp.logprob,
                              "bytes": list(t.encode())} for i, lp in ranked]})
    return {"content": content}


def _max_tokens(server: OpenAIServer, body: ChatCompletionRequest,
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


async def chat_completions(server: OpenAIServer, request: fastapi.Request):
    body = parse_body(await request.body(), ChatCompletionRequest)
    server.check_model(body)
    ids = await asyncio.to_thread(server.chat_prompt, body)
    top_n = body.top_logprobs or 0
    params_of = {"prompt_token_ids": "messages", "prompts": "messages",
                 "logprobs": "top_logprobs",
                 "max_tokens": ("max_completion_tokens"
                                if body.max_completion_tokens is not None else "max_tokens")}
    max_tokens, capped = _max_tokens(server, body, len(ids))
    params = server.sampling(body, max_tokens, top_n if body.logprobs else None, None,
                             params_of, body.prompt_logprobs)
    request_id = f"chatcmpl-{secrets.token_hex(12)}"
    turns = sum(m.role == "assistant" for m in body.messages)  # earlier turns in the prompt
    group = await server.add([PromptSpec(ids, params, request_id, None, body.cache_salt)],
                             params_of, body, request, turns)
    base = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": server.model_name}

    def extra(choice: CompletionOutput, start: int) -> dict:
        d = {}
        if body.logprobs:
            d["logprobs"] = logprobs_of(server, choice, start, top_n)
        if body.return_token_ids:
            d["token_ids"] = choice.token_ids[start:]
        return d

    if not body.stream:
        final = await server.collect(group, request)
        if final is None:
            return server.gone()
        out = final[request_id]
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text or ""},
                    "logprobs": None, **extra(c, 0), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason}
                   for c in out.outputs]
        response = {**base, "choices": choices, "usage": server.usage({request_id: out})}
        if body.prompt_logprobs is not None:  # vLLM: beside the choices
            response["prompt_logprobs"] = prompt_logprobs_json(
                out.prompt_logprobs, out.prompt_token_ids, body.prompt_logprobs)
        return server.respond(response, capped)
    chunk = {**base, "object": "chat.completion.chunk"}
    return server.stream(guard(_events(server, body, group, chunk, extra)), capped)


async def _events(server: OpenAIServer, body: ChatCompletionRequest, group, chunk: dict, extra):
    tracker = DeltaTracker(body.logprobs or body.return_token_ids or server.tokenizer is None)
    for j in range(body.n):  # one choice a chunk, as vLLM streams n > 1
        yield sse({**chunk, "choices": [{"index": j, "delta": {"role": "assistant",
                                                                "content": ""},
                                         "logprobs": None, "finish_reason": None}]})
    final: RequestOutput | None = None
    async with group:
        async for out in group:
            choices = []
            for c in out.outputs:
                delta = tracker.advance(c.index, c)
                if delta is None:
                    continue  # nothing new a client asked for (a held-back byte)
                text, _, tokens = delta
                choices.append({"index": c.index, "delta": {"content": text} if text else {},
                                "logprobs": None, **extra(c, tokens),
                                "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason})
            final = out if out.finished else final
            for choice in choices:
                yield sse({**chunk, "choices": [choice]})
    if body.stream_options is not None and body.stream_options.include_usage:
        yield sse({**chunk, "choices": [], "usage": server.usage({chunk["id"]: final})})
    yield DONE
