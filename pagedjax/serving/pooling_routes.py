"""The pooling endpoints of a server started with --runner pooling, as vLLM serves them:
POST /v1/embeddings (OpenAI's), /pooling, /classify, /score (and /v1/score), /rerank,
/v1/rerank and /v2/rerank (Jina's and Cohere's shape). A pooling server answers the generation
routes 400 naming its runner, and a generating one these routes (runner_routes).

    pagedjax serve MODEL --runner pooling
    curl localhost:8000/v1/embeddings -d '{"input": ["a text", "another"]}'
"""

from __future__ import annotations

import asyncio
import secrets
import time

import fastapi
import numpy as np

from pagedjax.engine.pooling_requests import pooling_spec
from pagedjax.engine.request_checks import encode_pair, encode_text
from pagedjax.pooling import scoring
from pagedjax.pooling.params import PoolingParams
from pagedjax.scheduler import RequestError
from pagedjax.serving import chat
from pagedjax.serving.http_common import APIError, parse_body
from pagedjax.serving.pooling_protocol import (ClassificationRequest, EmbeddingRequest,
                                               PoolingRequest, RerankRequest, ScoreRequest, encoded,
                                               split_inputs)
from pagedjax.serving.protocol import MAX_PROMPTS, usage_json
from pagedjax.serving.request_params import ParamNames, rejected
from pagedjax.serving.server_state import ServerState

PARAMS_OF: ParamNames = {"prompt_token_ids": "input", "pooling_params": None}
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
POOLING_PATHS = ("/v1/embeddings", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
                 "/v1/rerank", "/v2/rerank")


def _checked(server: ServerState, body) -> None:
    server.check_model_name(body.model)
    for param, why in body.unsupported():
        raise APIError(400, why, param)
    if hasattr(body, "chosen_activation") and body.chosen_activation()[1] is not None:
        field = body.chosen_activation()[1]
        raise APIError(400, f"{field}: use_activation, softmax and activation (its older "
                       "names) disagree", field)


async def _ids(server: ServerState, prompt, field: str, special_tokens: bool = True):
    """(token ids, text or None) of one input."""
    if not isinstance(prompt, str):
        return prompt, None
    try:
        return await asyncio.to_thread(encode_text, server.tokenizer, prompt, field,
                                       special_tokens), prompt
    except RequestError as e:
        raise APIError(400, str(e), field) from None


async def run_pooling(server: ServerState, body, request: fastapi.Request, prompts: list,
                      params: PoolingParams, task: str, prefix: str):
    """Queues one pooling request a prompt ((token ids, text[, token types]) tuples) and waits
    for them all: their outputs in order (None when the client went away)."""
    request_id = f"{prefix}-{body.request_id or secrets.token_hex(12)}"
    try:
        specs = [pooling_spec(server.engine, ids, params, task, f"{request_id}-{i}", text,
                              body.cache_salt, None, *types)
                 for i, (ids, text, *types) in enumerate(prompts)]
    except RequestError as e:
        raise rejected(e, PARAMS_OF) from None
    group = await server.add(specs, PARAMS_OF, body, request)
    final = await server.collect(group, request)
    if final is None:
        return None
    return [final[f"{request_id}-{i}"] for i in range(len(specs))]


def _base(server: ServerState, body, prefix: str, outputs) -> dict:
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": f"{prefix}-{secrets.token_hex(12)}", "object": "list",
            "created": int(time.time()), "model": server.reply_model(body.model),
            "usage": usage_json(tokens, 0)}


async def _inputs(server: ServerState, body) -> list:
    """(token ids, text or None) of each input, or of the conversation in messages."""
    for param, why in body.input_errors():
        raise APIError(400, why, param)
    if body.messages is not None:
        return [(await asyncio.to_thread(chat.render_prompt, server, body), None)]
    try:
        items = split_inputs(body.input)
    except ValueError as e:
        raise APIError(400, str(e), "input") from None
    special = body.add_special_tokens is not False
    return [await _ids(server, p, "input", special) for p in items]


async def embeddings(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), EmbeddingRequest)
    _checked(server, body)
    params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                           truncate_prompt_tokens=body.truncate_prompt_tokens)
    outputs = await run_pooling(server, body, request, await _inputs(server, body), params,
                                "embed", "embd")
    if outputs is None:
        return server.gone()
    data = [{"index": i, "object": "embedding", "embedding": encoded(o.outputs.data, body)}
            for i, o in enumerate(outputs)]
    return {**_base(server, body, "embd", outputs), "data": data}


async def pooling(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), PoolingRequest)
    _checked(server, body)
    task = body.task or server.engine.pooling_model.default_task
    fields = {k: getattr(body, k) for k in ("dimensions", "normalize")
              if getattr(body, k) is not None}
    if body.chosen_activation()[0] is not None:
        fields["use_activation"] = body.chosen_activation()[0]
    try:
        params = PoolingParams(**fields, truncate_prompt_tokens=body.truncate_prompt_tokens
                               ).verify(task)
    except RequestError as e:
        raise rejected(e, PARAMS_OF) from None
    outputs = await run_pooling(server, body, request, await _inputs(server, body), params,
                                task, "pool")
    if outputs is None:
        return server.gone()
    data = [{"index": i, "object": "pooling",
             "data": (o.outputs.data.tolist() if body.encoding_format == "float"
                      else encoded(o.outputs.data.reshape(-1), body))}
            for i, o in enumerate(outputs)]
    return {**_base(server, body, "pool", outputs), "data": data}


async def classify(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), ClassificationRequest)
    _checked(server, body)
    params = PoolingParams(use_activation=body.chosen_activation()[0],
                           truncate_prompt_tokens=body.truncate_prompt_tokens)
    outputs = await run_pooling(server, body, request, await _inputs(server, body), params,
                                "classify", "classify")
    if outputs is None:
        return server.gone()
    head = server.engine.pooling_model.head
    if head is None:  # _checked: classify is a task of a model with a classifier head
        raise APIError(400, "this model has no classifier head", "model")
    data = [{"index": i, "label": head.label(int(np.argmax(o.outputs.data))),
             "probs": o.outputs.data.tolist(), "num_classes": int(o.outputs.data.shape[0])}
            for i, o in enumerate(outputs)]
    return {**_base(server, body, "classify", outputs), "data": data}


async def _pairs(server: ServerState, firsts: list, seconds: list) -> list:
    """(token ids, None, token types or None) of each (first, second) pair read as one prompt
    (encode_pair; the types when the model reads them)."""
    reads_types = server.engine.pooling_model.token_types
    pairs = []
    for a, b in zip(firsts, seconds):
        try:
            ids, types = await asyncio.to_thread(encode_pair, server.tokenizer, a, b)
        except RequestError as e:
            raise APIError(400, str(e), e.field) from None
        pairs.append((ids, None, types if reads_types else None))
    return pairs


def _check_texts(texts: list, field: str) -> None:
    """At most MAX_PROMPTS texts (as /v1/embeddings' inputs), none empty: 400 naming the field
    (the item's index with it)."""
    if len(texts) > MAX_PROMPTS:
        raise APIError(400, f"{field} holds {len(texts)} items, more than {MAX_PROMPTS}", field)
    for i, text in enumerate(texts):
        if not text:
            raise APIError(400, f"{field}[{i}] must not be empty", field)


async def pair_scores(server: ServerState, body, request: fastapi.Request, firsts: list,
                      seconds: list, fields: tuple[str, str] = ("text_1", "text_2")
                      ) -> tuple[list[float], list] | None:
    """Each (first, second) text pair's score (scoring), and the outputs behind them; fields:
    the body's names of the two sides (the errors name them)."""
    head = server.engine.pooling_model.head
    _check_texts(firsts, fields[0])
    _check_texts(seconds, fields[1])
    try:
        firsts, seconds = scoring.pairs(firsts, seconds, fields[1])
        scoring.check_cross_encoder(head)
    except RequestError as e:
        raise APIError(400, str(e), e.field) from None
    if head is not None:
        params = PoolingParams(use_activation=body.chosen_activation()[0],
                               truncate_prompt_tokens=body.truncate_prompt_tokens)
        outputs = await run_pooling(server, body, request, await _pairs(server, firsts, seconds),
                                    params, "score", "score")
        return None if outputs is None else ([float(o.outputs.data[0]) for o in outputs],
                                             outputs)
    if body.chosen_activation()[0] is not None:
        raise APIError(400, "use_activation: an embedding model's score is the cosine of two "
                       "embeddings; it has no activation", "use_activation")
    texts = [await _ids(server, t, "text_1") for t in firsts + seconds]
    params = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens)
    outputs = await run_pooling(server, body, request, texts, params, "embed", "score")
    if outputs is None:
        return None
    n = len(firsts)
    return [scoring.cosine(a.outputs.data, b.outputs.data)
            for a, b in zip(outputs[:n], outputs[n:])], outputs


async def score(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), ScoreRequest)
    _checked(server, body)
    listed = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    others = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    scored = await pair_scores(server, body, request, listed, others)
    if scored is None:
        return server.gone()
    values, outputs = scored
    data = [{"index": i, "object": "score", "score": v} for i, v in enumerate(values)]
    return {**_base(server, body, "score", outputs), "data": data}


async def rerank(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), RerankRequest)
    _checked(server, body)
    texts = []
    for i, document in enumerate(body.documents):
        text = document.get("text") if isinstance(document, dict) else document
        if not isinstance(text, str) or (isinstance(document, dict) and set(document) != {
                "text"}):
            raise APIError(400, f"documents[{i}] must be a string or {{\"text\": string}}",
                           "documents")
        texts.append(text)
    scored = await pair_scores(server, body, request, [body.query], texts,
                               ("query", "documents"))
    if scored is None:
        return server.gone()
    values, outputs = scored
    order = sorted(range(len(values)), key=lambda i: -values[i])
    order = order[:body.top_n] if body.top_n else order
    results = [{"index": i, "relevance_score": values[i],
                **({"document": {"text": texts[i]}} if body.return_documents else {})}
               for i in order]
    base = _base(server, body, "rerank", outputs)
    return {"id": base["id"], "model": base["model"], "results": results,
            "usage": {"total_tokens": base["usage"]["total_tokens"]}}


def runner_routes(server: ServerState, app: fastapi.FastAPI) -> None:
    """The routes of the server's runner, and 400 naming it on the other runner's."""
    pooling_server = server.engine.runner_type == "pooling"
    refused = GENERATION_PATHS if pooling_server else POOLING_PATHS

    def refuse(path: str):
        async def refusal(request: fastapi.Request):
            raise APIError(400, f"{path} is not served by this server's runner "
                           f"({'pooling' if pooling_server else 'generate'}); start "
                           f"`pagedjax serve` with --runner "
                           f"{'generate' if pooling_server else 'pooling'} for it")
        return refusal

    for path in refused:  # not this runner's: out of its document
        app.post(path, include_in_schema=False)(refuse(path))
    if not pooling_server:
        return
    handlers = {"/v1/embeddings": embeddings, "/pooling": pooling, "/classify": classify,
                "/score": score, "/v1/score": score, "/rerank": rerank, "/v1/rerank": rerank,
                "/v2/rerank": rerank}
    for path, handler in handlers.items():
        app.post(path)(_bound(server, handler))


def _bound(server: ServerState, handler):
    async def route(request: fastapi.Request):
        return await handler(server, request)
    return route
