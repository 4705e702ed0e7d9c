"""Every field of OpenAI's request schemas (read from the installed `openai` package's types) and
of vLLM's extensions is either served (a request setting it to a non-default value answers 200)
or refused by name (400 whose `param` is the field): none is dropped. The server's own body
models hold nothing outside these lists, so a field added there must be declared here."""

from __future__ import annotations

import json
import typing

import pytest
from fastapi.testclient import TestClient
from helpers import RAG_TEMPLATE
from test_server import ENGINE

from pagedjax import LLM
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.protocol import ChatCompletionRequest, CompletionRequest

openai_types = pytest.importorskip("openai.types")

# A non-default value for each served field (both endpoints unless the endpoint overrides).
SERVED = {
    "model": "tiny", "max_tokens": 3, "n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 5,
    "min_p": 0.1, "seed": 3, "stop": ["zz"], "stop_token_ids": [7], "stream": True,
    "stream_options": {"include_usage": True}, "ignore_eos": True, "skip_special_tokens": False,
    "include_stop_str_in_output": True, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "repetition_penalty": 1.2, "min_tokens": 1, "allowed_token_ids": [97, 98, 99],
    "bad_words": ["q"], "logit_bias": {"97": 1.0}, "user": "u1", "cache_salt": "s",
    "return_token_ids": True, "response_format": {"type": "json_object"},
    "structured_outputs": {"regex": "[ab]{2}"}, "guided_json": {"type": "object"},
    "guided_regex": "[ab]{2}", "guided_choice": ["a", "b"], "guided_grammar": 'start: "ab"',
    "guided_decoding_backend": "guidance", "prompt_logprobs": 1, "metadata": {"a": "b"},
}
# Chat's fields beyond the shared ones: tool calling (tests/serving/test_tool_calls.py), the template's
# inputs, and the fields with no effect on a self-hosted engine by nature (README's API
# section), served with what a client sends.
CHAT_ONLY_SERVED = {
    "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none",
    "parallel_tool_calls": False, "functions": [{"name": "f"}], "function_call": "none",
    "reasoning_effort": "low", "continue_final_message": True, "store": True,
    "service_tier": "auto", "safety_identifier": "x", "prompt_cache_key": "k",
    "prompt_cache_retention": "in_memory", "modalities": ["text"], "include_reasoning": False,
}
COMPLETION_SERVED = {**SERVED, "prompt": "copy:ab=", "best_of": 2, "logprobs": 2, "echo": True}
CHAT_SERVED = {**SERVED, "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
               "top_logprobs": 2, "max_completion_tokens": 3, "add_generation_prompt": False,
               "chat_template_kwargs": {"x": 1}, "documents": [{"text": "d"}],
               **CHAT_ONLY_SERVED}
# Refused by name whatever their value (or with the value given here).
REFUSED = {
    # suffix: vLLM refuses it too ("suffix is not currently supported"); prediction is served
    # by a speculative engine only (tests/engine/test_predicted_outputs.py), this one refuses it;
    # audio output cannot be honoured.
    "suffix": "x", "guided_whitespace_pattern": " ", "audio": {"voice": "x"},
    "moderation": {}, "prediction": {"type": "content", "content": "ab"},
    "prompt_cache_options": {},
    "verbosity": "low", "web_search_options": {},
    # vLLM's extensions this server does not implement (priority: only 0, as vLLM without
    # priority scheduling)
    "use_beam_search": True, "length_penalty": 2.0,
    "truncate_prompt_tokens": 4, "spaces_between_special_tokens": False,
    "add_special_tokens": False, "structural_tag": "x", "priority": 1, "request_id": "r",
    "logits_processors": ["x"], "return_tokens_as_token_ids": True, "kv_transfer_params": {},
    "vllm_xargs": {}, "prompt_embeds": "x",
    "chat_template": "x", "mm_processor_kwargs": {},
    "thinking_token_budget": 8, "watermarking": True, "truncation_side": "left",
    "logprob_token_ids": [1], "media_io_kwargs": {}, "session_id": "s",
}
# Values of served fields that are refused by name: what cannot be honoured.
REFUSED_VALUES = {"modalities": ["text", "audio"], "prompt_cache_retention": "24h",
                  "service_tier": "flex", "priority": 1, "reasoning_effort": "extreme",
                  # OpenAI's bound on its identifiers (a stored response echoes them)
                  "user": "u" * 65, "safety_identifier": "s" * 65,
                  "prompt_cache_key": "k" * 65}
# Each endpoint's fields the other does not have are refused there by name.
REFUSED.update({"echo": True, "add_generation_prompt": False, "chat_template_kwargs": {"x": 1},
                "documents": [{"text": "d"}],
                "top_logprobs": 2, "max_completion_tokens": 3, "best_of": 2, "prompt": "x",
                **CHAT_ONLY_SERVED})
# vLLM's extensions (its CompletionRequest / ChatCompletionRequest beyond OpenAI's fields).
VLLM_FIELDS = {
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids",
    "include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "allowed_token_ids",
    "bad_words", "response_format", "structured_outputs", "guided_json", "guided_regex",
    "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern",
    "cache_salt", "return_token_ids", "use_beam_search", "length_penalty", "prompt_logprobs",
    "truncate_prompt_tokens", "spaces_between_special_tokens", "add_special_tokens",
    "structural_tag", "priority", "request_id", "logits_processors",
    "return_tokens_as_token_ids", "kv_transfer_params", "vllm_xargs", "prompt_embeds"}
VLLM_CHAT_FIELDS = {"echo", "add_generation_prompt", "continue_final_message", "documents",
                    "chat_template", "chat_template_kwargs", "mm_processor_kwargs",
                    "include_reasoning", "thinking_token_budget", "watermarking",
                    "truncation_side", "logprob_token_ids", "media_io_kwargs", "session_id"}


COMPANIONS = {"top_logprobs": {"logprobs": True}, "best_of": {"n": 1},  # what they need beside
              "tools": {"tool_choice": "none"}, "tool_choice": {"tools": CHAT_ONLY_SERVED["tools"]},
              "functions": {"function_call": "none"},
              "function_call": {"functions": CHAT_ONLY_SERVED["functions"]},
              "continue_final_message": {"add_generation_prompt": False}}


def openai_fields(module) -> set[str]:
    return set(typing.get_type_hints(module.CompletionCreateParamsBase)) | {"stream"}


ENDPOINTS = {
    "/v1/completions": (COMPLETION_SERVED, CompletionRequest,
                        openai_fields(openai_types.completion_create_params) | VLLM_FIELDS),
    "/v1/chat/completions": (CHAT_SERVED, ChatCompletionRequest,
                             openai_fields(openai_types.chat.completion_create_params)
                             | VLLM_FIELDS | VLLM_CHAT_FIELDS),
}


@pytest.fixture(scope="module")
def client():
    server = OpenAIServer(LLM(**ENGINE).engine, "tiny", chat_template=RAG_TEMPLATE)
    with TestClient(server.build_app()) as client:
        yield client


def base_body(path: str) -> dict:
    if path == "/v1/completions":
        return {"prompt": "copy:ab=", "max_tokens": 2}
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_every_schema_field_is_served_or_refused_by_name(client, path):
    served, model, names = ENDPOINTS[path]
    undeclared = names - set(served) - set(REFUSED)
    assert not undeclared, f"fields neither served nor refused: {sorted(undeclared)}"
    assert set(model.model_fields) <= set(served) | set(REFUSED), \
        sorted(set(model.model_fields) - set(served) - set(REFUSED))
    for name in sorted(names):
        if name in served:
            body = {**base_body(path), **COMPANIONS.get(name, {}), name: served[name]}
            response = client.post(path, json=body)
            assert response.status_code == 200, (name, response.text)
        else:
            response = client.post(path, json={**base_body(path), name: REFUSED[name]})
            assert response.status_code == 400, (name, response.text)
            assert response.json()["error"]["param"] == name, (name, response.json())


@pytest.mark.parametrize("name", sorted(REFUSED_VALUES))
def test_values_that_cannot_be_honoured_are_refused_by_name(client, name):
    path = "/v1/chat/completions"
    response = client.post(path, json={**base_body(path), name: REFUSED_VALUES[name]})
    assert response.status_code == 400, (name, response.text)
    assert response.json()["error"]["param"] == name


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_identifiers_are_bounded_as_openai_bounds_them(client, path):
    """user at OpenAI's 64 characters is served on both endpoints, 65 refused by name (the
    Responses API: tests/serving/test_responses.py)."""
    assert client.post(path, json={**base_body(path), "user": "u" * 64}).status_code == 200
    response = client.post(path, json={**base_body(path), "user": "u" * 65})
    assert response.status_code == 400 and response.json()["error"]["param"] == "user"
    assert "at most 64 characters" in response.json()["error"]["message"]


def _chunks(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.text.splitlines()
            if line.startswith("data: {")]


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(client, path):
    """vLLM's stream_options.continuous_usage_stats (guidellm's default): every chunk carries
    the usage so far, growing a token at a time to the final usage."""
    body = {**base_body(path), "max_tokens": 6, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _chunks(client.post(path, json=body))
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 6 and usages[-1] == chunks[-1]["usage"]
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    assert len({u["prompt_tokens"] for u in usages}) == 1
    plain = _chunks(client.post(path, json={**body, "stream_options": {"include_usage": True}}))
    assert all("usage" not in c for c in plain[:-1]) and plain[-1]["usage"] == usages[-1]


def test_continue_final_message_continues_it(client):
    """The final assistant message left open: the prompt ends with its text, no end of turn
    and no new generation prompt (as /tokenize renders it too)."""
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answ"}]
    closed = client.post("/tokenize", json={"messages": messages,
                                            "add_generation_prompt": False}).json()["tokens"]
    ids = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False,
                                         "continue_final_message": True}).json()["tokens"]
    text = client.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.endswith("The answ") and ids == closed[:len(ids)] and len(ids) < len(closed)
    response = client.post("/v1/chat/completions", json={
        "messages": messages, "add_generation_prompt": False, "continue_final_message": True,
        "max_tokens": 2})
    assert response.status_code == 200
    assert response.json()["usage"]["prompt_tokens"] == len(ids)


def test_a_message_needs_a_role(client):
    for role in ("", "x" * 65):
        response = client.post("/v1/chat/completions", json={
            "messages": [{"role": role, "content": "hi"}], "max_tokens": 2})
        assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("details", [False, True])
def test_prompt_tokens_details_report_the_prefix_cache(details):
    """--enable-prompt-tokens-details (vLLM's): usage.prompt_tokens_details.cached_tokens is the
    prompt tokens the prefix cache served (0 the first time, whole blocks the second), in the
    non-streamed and the streamed usage; without the flag the usage has no details."""
    engine = LLM(**ENGINE).engine
    server = OpenAIServer(engine, "tiny", enable_prompt_tokens_details=details)
    block = engine.config.block_size
    body = {"prompt": "copy:" + "paged attention " * 3 + "=", "max_tokens": 2}
    with TestClient(server.build_app()) as client:
        first = client.post("/v1/completions", json=body).json()["usage"]
        second = client.post("/v1/completions", json=body).json()["usage"]
        streamed = _chunks(client.post("/v1/completions", json={
            **body, "stream": True, "stream_options": {"include_usage": True}}))[-1]["usage"]
    if not details:
        assert "prompt_tokens_details" not in first and "prompt_tokens_details" not in streamed
        return
    prompt = first["prompt_tokens"]
    assert prompt > 2 * block and first["prompt_tokens_details"] == {"cached_tokens": 0}
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == (prompt - 1) // block * block and cached > 0
    assert streamed["prompt_tokens_details"] == {"cached_tokens": cached}
