"""The official openai client against a real `pagedjax` server (uvicorn on 127.0.0.1): completions,
chat, streaming with n=2 (a choice a chunk), logprobs, models, an error body the client raises
as its own exception, and the tokenize round trip (httpx: the client has no such call)."""

from __future__ import annotations

import httpx
import openai
import pytest
from helpers import ROLE_TEMPLATE
from test_server import ENGINE, PROMPTS

from pagedjax import LLM, SamplingParams
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer


@pytest.fixture(scope="module")
def served():
    llm = LLM(**ENGINE)
    # The offline reference first: once serving, the engine belongs to the server's thread.
    llm.reference = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0,
                                                              logprobs=2), use_tqdm=False)[0]
    llm.prompt_reference = llm.generate([PROMPTS[2]], SamplingParams(
        max_tokens=3, temperature=0, logprobs=1, prompt_logprobs=2), use_tqdm=False)[0]
    server = OpenAIServer(llm.engine, "tiny", chat_template=ROLE_TEMPLATE)
    with BackgroundServer(server.build_app()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60,
                               max_retries=0)
        yield llm, client, url


def test_completions_and_logprobs_equal_offline(served):
    llm, client, _ = served
    want = llm.reference
    got = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                    temperature=0, logprobs=2)
    choice = got.choices[0]
    assert choice.text == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert len(choice.logprobs.tokens) == len(want.outputs[0].token_ids)
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert choice.model_extra["stop_reason"] is None  # the length limit or EOS
    stop = want.outputs[0].text[2:4]
    stopped = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                        temperature=0, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop" and stopped.model_extra["stop_reason"] == stop
    # vLLM's min_p (extra_body, as the client sends vLLM's fields): 1.0 keeps only the top token.
    top_only = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=8,
                                         temperature=1.5, seed=5, extra_body={"min_p": 1.0})
    assert top_only.choices[0].text == choice.text
    [z] = llm.tokenizer.encode("z", add_special_tokens=False)
    forced = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4,
                                       temperature=0, logit_bias={str(z): 100})
    assert forced.choices[0].text == "zzzz"  # OpenAI's logit_bias, greedy rows included
    with pytest.raises(openai.BadRequestError, match="min_p"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                  extra_body={"min_p": 2.0})


def test_streaming_n2_sends_a_choice_a_chunk(served):
    _, client, _ = served
    whole = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, n=2,
                                      temperature=0.8, seed=3)
    stream = client.completions.create(model="tiny", prompt=PROMPTS[1], max_tokens=6, n=2,
                                       temperature=0.8, seed=3, stream=True)
    texts = {0: "", 1: ""}
    for chunk in stream:
        assert len(chunk.choices) == 1
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {c.index: c.text for c in whole.choices}


def test_chat_whole_and_streamed(served):
    _, client, _ = served
    messages = [{"role": "user", "content": "copy:abc="}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                           temperature=0)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       client.chat.completions.create(model="tiny", messages=messages,
                                                      max_tokens=6, temperature=0,
                                                      stream=True)
                       if chunk.choices)
    assert streamed == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"


def test_refusals_reach_the_client_as_its_errors(served):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt="x", max_tokens=10 ** 6)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=2)


def test_tokenize_round_trip(served):
    llm, client, url = served
    text = "rev:paged attention="
    tokens = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()["tokens"]
    assert tokens == llm.tokenizer.encode(text)
    got = client.completions.create(model="tiny", prompt=tokens, max_tokens=4, temperature=0)
    assert got.usage.prompt_tokens == len(tokens)
    bare = httpx.post(f"{url}/tokenize", json={"prompt": text,
                                               "add_special_tokens": False}).json()["tokens"]
    assert httpx.post(f"{url}/detokenize", json={"tokens": bare}).json() == {"prompt": text}


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rooms"],
          "properties": {"city": {"type": "string", "enum": ["oslo", "rome", "lima"]},
                         "rooms": {"type": "integer", "minimum": 1, "maximum": 9}}}


def test_structured_output_with_a_json_schema_parses_and_validates(served):
    """OpenAI's response_format (json_schema) on chat (with vLLM's disable_any_whitespace: the
    embedded model writes newlines when it may), vLLM's structured_outputs and guided_*
    fields on completions (extra_body, as the client sends vLLM's fields): sampled outputs
    parse and validate against the schema; a choice is one of the choices."""
    import json

    import jsonschema
    _, client, _ = served
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a hotel as JSON"}],
        max_tokens=64, temperature=1.0, seed=2, n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "hotel",
                                                                "schema": SCHEMA}},
        extra_body={"structured_outputs": {"disable_any_whitespace": True}})  # vLLM's option
    for choice in chat.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert choice.finish_reason == "stop"
    completion = client.completions.create(
        model="tiny", prompt="hotel:", max_tokens=64, temperature=1.0, seed=3,
        extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})
    text = completion.choices[0].text
    jsonschema.validate(json.loads(text), SCHEMA)
    assert " " not in text
    picked = client.completions.create(model="tiny", prompt="pick:", max_tokens=8,
                                       temperature=1.0, seed=4,
                                       extra_body={"guided_choice": ["left", "right"]})
    assert picked.choices[0].text in ("left", "right")
    with pytest.raises(openai.BadRequestError, match="guided_regex"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2,
                                  extra_body={"guided_regex": "a(b"})


def test_prompt_logprobs_and_echo_with_logprobs(served):
    """vLLM's prompt_logprobs (per completion choice, beside the chat choices) and OpenAI's echo
    with logprobs (the prompt's tokens lead the logprobs, the first without one), whole and
    streamed, equal the offline engine's; with stream, prompt_logprobs is refused by name."""
    llm, client, _ = served
    want = llm.prompt_reference
    wire = [None] + [{str(t): {"logprob": lp.logprob, "rank": lp.rank,
                               "decoded_token": lp.decoded_token} for t, lp in entry.items()}
                     for entry in want.prompt_logprobs[1:]]
    got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=3,
                                    temperature=0, extra_body={"prompt_logprobs": 2})
    assert got.choices[0].model_extra["prompt_logprobs"] == wire
    assert len(wire) == len(want.prompt_token_ids)
    echoed = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=3,
                                       temperature=0, echo=True, logprobs=1).choices[0]
    num_prompt = len(want.prompt_token_ids)
    assert echoed.text == PROMPTS[2] + want.outputs[0].text
    assert echoed.logprobs.tokens[:num_prompt] == [llm.tokenizer.decode([t], False) for t in
                                                   want.prompt_token_ids]
    assert echoed.logprobs.token_logprobs[0] is None and echoed.logprobs.top_logprobs[0] is None
    assert echoed.logprobs.token_logprobs[1:num_prompt] == [
        entry[t].logprob for t, entry in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:])]
    assert echoed.logprobs.token_logprobs[num_prompt:] == [
        entry[t].logprob for t, entry in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)]
    assert all(len(top) <= 2 for top in echoed.logprobs.top_logprobs[1:])  # logprobs=1: + itself
    first, *rest = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=3,
                                             temperature=0, echo=True, logprobs=1, stream=True)
    assert first.choices[0].text == PROMPTS[2]
    assert first.choices[0].logprobs.token_logprobs == echoed.logprobs.token_logprobs[:num_prompt]
    assert "".join(c.choices[0].text for c in rest) == want.outputs[0].text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                                                   "content": "copy:ab="}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 and next(iter(entry.values()))["rank"] >= 1
               for entry in entries[1:])  # prompt_logprobs=0: the token itself only
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
