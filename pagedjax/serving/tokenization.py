"""POST /tokenize and POST /detokenize, as vLLM serves them: a text (or a conversation through the
chat template) to the token ids the engine would see, and token ids back to text.

    curl localhost:8000/tokenize -d '{"prompt": "copy:hello="}'
    -> {"count": 12, "max_model_len": 512, "tokens": [...], "token_strs": null}
    curl localhost:8000/detokenize -d '{"tokens": [99, 111]}'  -> {"prompt": "co"}
"""

from __future__ import annotations

import asyncio
import json

import fastapi

from pagedjax.engine.request_checks import encode_text
from pagedjax.scheduler import RequestError
from pagedjax.serving import chat
from pagedjax.serving.http_common import APIError, parse_body
from pagedjax.serving.protocol import (DetokenizeRequest, TokenizeChatRequest,
                                       TokenizeCompletionRequest)
from pagedjax.serving.server_state import ServerState


def _is_chat(raw: bytes) -> bool:
    """A body with "messages" is the chat form (vLLM tells the two apart the same way)."""
    try:
        return isinstance(data := json.loads(raw), dict) and "messages" in data
    except (ValueError, RecursionError):
        return False  # parse_body answers the malformed (or too deeply nested) JSON


def _tokenizer(server: ServerState, field: str):
    if server.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: there is nothing to tokenize with "
                       "(send token ids to /v1/completions)", field)
    return server.tokenizer


async def tokenize(server: ServerState, request: fastapi.Request):
    raw = await request.body()
    if _is_chat(raw):
        body = parse_body(raw, TokenizeChatRequest)
        server.check_model_name(body.model)
        if body.add_special_tokens:
            raise APIError(400, "add_special_tokens: a conversation's special tokens are the "
                           "chat template's; only false is supported", "add_special_tokens")
        ids = await asyncio.to_thread(chat.render_prompt, server, body)
    else:
        body = parse_body(raw, TokenizeCompletionRequest)
        server.check_model_name(body.model)
        tokenizer = _tokenizer(server, "prompt")
        try:
            ids = await asyncio.to_thread(encode_text, tokenizer, body.prompt, "prompt",
                                          body.add_special_tokens)
        except RequestError as e:
            raise APIError(400, str(e), "prompt") from None
    token_strs = None
    if body.return_token_strs:
        token_strs = server.tokenizer.convert_ids_to_tokens(ids)
    return {"count": len(ids), "max_model_len": server.engine.config.max_model_len,
            "tokens": ids, "token_strs": token_strs}


async def detokenize(server: ServerState, request: fastapi.Request):
    body = parse_body(await request.body(), DetokenizeRequest)
    server.check_model_name(body.model)
    tokenizer = _tokenizer(server, "tokens")
    bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise APIError(400, f"tokens: {bad[0]} is outside the tokenizer's vocabulary "
                       f"(0 .. {tokenizer.vocab_size - 1})", "tokens")
    text = await asyncio.to_thread(tokenizer.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text}
