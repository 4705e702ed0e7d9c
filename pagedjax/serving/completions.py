"""POST /v1/completions: prompts (text, token ids, or lists of either) in, choices out, whole or
streamed."""

from __future__ import annotations

import asyncio
import secrets
import time

import fastapi

from pagedjax.engine.outputs import CompletionOutput, RequestOutput
from pagedjax.frontend.async_engine import PromptSpec
from pagedjax.serving.http_common import APIError, parse_body
from pagedjax.serving.protocol import (CompletionRequest, prompt_logprobs_json, split_prompts,
                                       usage_json, wire_logprob)
from pagedjax.serving.request_params import ParamNames
from pagedjax.serving.server_state import ServerState
from pagedjax.serving.streaming import DONE, DeltaTracker, guard, sse

# engine field -> body field
PARAMS_OF: ParamNames = {"prompt_token_ids": "prompt", "prompts": "prompt"}


def logprobs_of(server: ServerState, token_ids, entries, offset: int,
                num_top: int | None = None) -> dict:
    """OpenAI's completion logprobs (tokens, token_logprobs, top_logprobs, text_offset) of
    token_ids, entries their engine logprobs (None for an echoed prompt's first token); num_top
    trims an entry to the token and its num_top most likely."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, top in zip(token_ids, entries):
        text = server.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(None if top is None else wire_logprob(top[token_id].logprob))
        tops.append(None if top is None else {
            server.token_text(t): wire_logprob(lp.logprob) for t, lp in top.items()
            if num_top is None or t == token_id or lp.rank is not None and lp.rank <= num_top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops,
            "text_offset": offsets}


def _joined(first: dict, second: dict) -> dict:
    return {key: first[key] + second[key] for key in first}


class _Choices:
    """Builds the choice dicts of one completion request (its prompts, their echo, n)."""

    def __init__(self, server: ServerState, body: CompletionRequest, specs, echo: list[str]):
        self.server, self.body, self.echo = server, body, echo
        self.index_of = {spec.request_id: i for i, spec in enumerate(specs)}

    def choice(self, out: RequestOutput, choice: CompletionOutput, text: str, offset: int,
               prompt_logprobs: list | None = None) -> dict:
        """A choice dict of choice's tokens (a DELTA one's, or a whole one's); with
        prompt_logprobs (the request's: its first chunk, or the whole choice) the prompt's ids
        and logprobs go with it."""
        body = self.body
        logprobs = None
        if body.logprobs is not None:
            logprobs = logprobs_of(self.server, choice.token_ids, choice.logprobs or [], offset)
        d = {"index": self.index_of[out.request_id] * body.n + choice.index, "text": text,
             "logprobs": logprobs, "finish_reason": choice.finish_reason,
             "stop_reason": choice.stop_reason}
        first = prompt_logprobs is not None
        if body.return_token_ids or self.server.tokenizer is None:  # no text without one
            d["token_ids"] = choice.token_ids
            if first:
                d["prompt_token_ids"] = out.prompt_token_ids
        if body.prompt_logprobs is not None and first:
            d["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs, out.prompt_token_ids,
                                                        body.prompt_logprobs)
        return d

    def echoed_logprobs(self, out: RequestOutput) -> dict | None:
        """echo with logprobs: the prompt's tokens as OpenAI lists them (the first without a
        logprob), from the engine's prompt logprobs."""
        if not (self.body.echo and self.body.logprobs is not None):
            return None
        return logprobs_of(self.server, out.prompt_token_ids, out.prompt_logprobs, 0,
                           self.body.logprobs)

    def whole(self, final: dict[str, RequestOutput]) -> list[dict]:
        choices = []
        for rid in self.index_of:
            out, prefix = final[rid], self.echo[self.index_of[rid]]
            echoed = self.echoed_logprobs(out)
            for choice in out.outputs:
                d = self.choice(out, choice, prefix + (choice.text or ""), len(prefix),
                                out.prompt_logprobs or [])
                if echoed is not None:
                    d["logprobs"] = _joined(echoed, d["logprobs"])
                choices.append(d)
        return choices


async def completions(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), CompletionRequest)
    lora = server.check_model(body)
    try:
        prompts = split_prompts(body.prompt)
    except ValueError as e:
        raise APIError(400, str(e), "prompt") from None
    max_tokens, capped = server.max_tokens(body.max_tokens, 16)  # OpenAI's default: 16
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # the echoed prompt's logprobs
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    params_of: ParamNames = dict(PARAMS_OF)  # this request's (sampling adds its own fields)
    params = await asyncio.to_thread(  # a prediction's tokenizing: off the event loop
        server.sampling, body, max_tokens, body.logprobs, body.best_of, params_of,
        prompt_logprobs)
    encoded = [await server.encode(p, "prompt") for p in prompts]
    request_id = f"cmpl-{secrets.token_hex(12)}"
    specs = [PromptSpec(ids, params, f"{request_id}-{i}", text, body.cache_salt,
                        lora_request=lora) for i, (ids, text) in enumerate(encoded)]
    group = await server.add(specs, params_of, body, request)
    tokenizer = server.tokenizer
    echo = [(text if text is not None else tokenizer.decode(list(ids)))
            if body.echo and tokenizer is not None else "" for ids, text in encoded]
    choices = _Choices(server, body, specs, echo)
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": server.reply_model(body.model)}
    if not body.stream:
        final = await server.collect(group, request)
        if final is None:
            return server.gone()
        usage = server.usage(final, body.prediction is not None)
        return server.respond({**base, "choices": choices.whole(final), "usage": usage}, capped)
    num_prompt = sum(len(ids) for ids, _ in encoded)
    return server.stream(guard(_events(server, body, group, choices, base, num_prompt)), capped)


async def _events(server: ServerState, body: CompletionRequest, group, choices: _Choices,
                  base: dict, num_prompt: int):
    # Without a tokenizer there is no text: every token is news.
    tracker = DeltaTracker(body.logprobs is not None or body.return_token_ids
                           or server.tokenizer is None)
    final: dict[str, RequestOutput] = {}
    continuous = body.stream_options is not None and body.stream_options.continuous_usage_stats
    generated: dict[tuple, int] = {}  # tokens so far, by (request, choice)

    def chunk(payload: dict) -> str:
        if continuous:  # vLLM's: the usage so far in every chunk
            payload = {**payload, "usage": usage_json(num_prompt, sum(generated.values()))}
        return sse(payload)
    # The echo goes first; with logprobs it waits for the request's first output (which
    # carries the prompt's logprobs).
    deferred = body.logprobs is not None
    for i, prefix in enumerate(choices.echo):
        for j in range(body.n):
            if prefix and not deferred:
                yield chunk({**base, "choices": [{"index": i * body.n + j, "text": prefix,
                                                "logprobs": None, "finish_reason": None}]})
    prompts: dict[str, RequestOutput] = {}  # each request's first output: its prompt logprobs
    async with group:
        async for out in group:
            i = choices.index_of[out.request_id]
            first = prompts.setdefault(out.request_id, out)
            if deferred and choices.echo[i] and first is out:
                for j in range(body.n):
                    yield chunk({**base, "choices": [{
                        "index": i * body.n + j, "text": choices.echo[i],
                        "logprobs": choices.echoed_logprobs(out), "finish_reason": None}]})
            sent = []
            for choice in out.outputs:
                generated[out.request_id, choice.index] = choice.num_tokens
                delta = tracker.advance((out.request_id, choice.index), choice)
                if delta is None:
                    continue  # nothing new a client asked for (a held-back byte)
                text, chars, first_chunk = delta
                offset = len(choices.echo[i]) + chars
                sent.append(choices.choice(out, choice, text, offset, (
                    first.prompt_logprobs or []) if first_chunk else None))
            if out.finished:
                final[out.request_id] = out
            for sent_choice in sent:  # one choice a chunk, as vLLM streams n > 1
                yield chunk({**base, "choices": [sent_choice]})
    if body.stream_options is not None and body.stream_options.include_usage:
        usage = server.usage(final, body.prediction is not None)
        yield sse({**base, "choices": [], "usage": usage})
    yield DONE
