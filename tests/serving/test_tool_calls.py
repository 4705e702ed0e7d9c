"""Tool calling through the official openai client against a real server (uvicorn on 127.0.0.1),
on a random model over the byte tokenizer with the ChatML tool template pagedjax ships:
"required" and named choices constrained to the tools' schemas, "auto" read by the hermes and
llama3_json parsers (the model's reply forced with guided_regex, so the parser sees what a tool
model writes), streamed deltas (the name first, then the arguments; no piece of a tag as
content), the deprecated functions spelling, a tool round trip through the template, and the
refusals."""

from __future__ import annotations

import dataclasses
import json

import jsonschema
import openai
import pytest
from fastapi.testclient import TestClient

from pagedjax import LLM
from pagedjax.models import get_config, init_model
from pagedjax.serving.app import OpenAIServer
from pagedjax.serving.background import BackgroundServer
from pagedjax.text.tokenizer import read_chat_template

# Clients driving a real server: run by make test-clients (and CI), beside the client suite,
# to keep make test within its time.
pytestmark = pytest.mark.clients

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                           "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "Weather in Rome?"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # short replies, fast tests
HERMES_REPLY = ('Sure\\.\n<tool_call>\n\\{"name": "get_weather", "arguments": '
                '\\{"city": "Rome"\\}\\}\n</tool_call>')


def _serve(parser: str | None):
    config = dataclasses.replace(get_config("debug-tiny"), vocab_size=264, eos_token_id=257,
                                 max_position_embeddings=2048)
    llm = LLM(init_model(config, seed=3), tokenizer="byte", max_model_len=1024, max_num_seqs=8,
              max_num_batched_tokens=1024)
    return OpenAIServer(llm.engine, "tiny", chat_template=read_chat_template("tool_chatml"),
                        tool_call_parser=parser, enable_auto_tool_choice=parser is not None)


@pytest.fixture(scope="module")
def client():
    with BackgroundServer(_serve("hermes").build_app()) as url:
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)


def _schema_of(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def test_required_choice_calls_a_tool_with_valid_arguments(client):
    reply = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=300,
                                           temperature=0, extra_body=COMPACT)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), _schema_of(call.function.name))
    single = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_tokens=300, temperature=0, extra_body=COMPACT)
    assert len(single.choices[0].message.tool_calls) == 1


def test_named_choice_streams_the_name_then_the_arguments(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                            tool_choice=named, max_tokens=60, stream=True,
                                            temperature=0, extra_body=COMPACT)
    deltas, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content  # the reply is the call, not content
            deltas += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert all(d.function.name is None for d in deltas[1:]) and {d.index for d in deltas} == {0}
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), CITY)
    assert finish == "stop"  # as OpenAI answers a forced function


@pytest.mark.parametrize("stream", [False, True])
def test_auto_choice_reads_hermes_calls_from_the_reply(client, stream):
    body = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=100,
                extra_body={"guided_regex": HERMES_REPLY})
    if not stream:
        choice = client.chat.completions.create(**body).choices[0]
        content, calls, finish = choice.message.content, choice.message.tool_calls, \
            choice.finish_reason
        calls = [(c.function.name, c.function.arguments) for c in calls]
    else:
        content, parts, finish = "", {}, None
        for chunk in client.chat.completions.create(**body, stream=True):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                for d in choice.delta.tool_calls or []:
                    name, arguments = parts.get(d.index, ("", ""))
                    parts[d.index] = (name + (d.function.name or ""),
                                      arguments + (d.function.arguments or ""))
                finish = choice.finish_reason or finish
        calls = [parts[i] for i in sorted(parts)]
        assert "<" not in content  # no piece of a tag leaked
        content = content.strip()
    assert content == "Sure."
    assert calls == [("get_weather", '{"city": "Rome"}')] and finish == "tool_calls"


def test_a_tool_round_trip_goes_through_the_template(client):
    """The call the model made and the tool's answer, sent back, render as the template writes
    them (the arguments as an object), and the conversation goes on."""
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "25C and sunny"}]
    reply = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS,
                                           tool_choice="none", max_tokens=3)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    template = read_chat_template("tool_chatml")
    from pagedjax.text.tokenizer import render_chat_template
    rendered = render_chat_template(template, [
        {**m, "content": m["content"] or ""} for m in history[:1]] + [
        {"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "get_weather", "arguments": {"city": "Rome"}}}]},
        {"role": "tool", "content": "25C and sunny"}], True, tools=TOOLS)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' \
        in rendered
    assert "<tool_response>\n25C and sunny\n</tool_response>" in rendered
    assert reply.usage.prompt_tokens == len(rendered.encode())  # the byte tokenizer
    # A template that reads the arguments' fields sees an object, not the string sent.
    reads = ("{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}("
             "{{ c.function.arguments.city }}){% endfor %}{% endfor %}")
    server = _serve(None)
    server.chat_template = reads
    with TestClient(server.build_app()) as plain:
        ids = plain.post("/tokenize", json={"messages": history}).json()["tokens"]
        assert plain.post("/detokenize", json={"tokens": ids}).json()["prompt"] == \
            "get_weather(Rome)"


def test_deprecated_functions_answer_a_function_call(client):
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, functions=[t["function"] for t in TOOLS],
        function_call={"name": "get_weather"}, max_tokens=60, temperature=0,
        extra_body=COMPACT)
    choice = reply.choices[0]
    assert choice.message.function_call.name == "get_weather"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), CITY)
    assert choice.message.tool_calls is None


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools"),
    ({"tools": [], "tool_choice": "required"}, "tool_choice"),  # an empty list: no tools
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),  # a name twice
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),  # two constraints
    ({"tools": TOOLS, "functions": [TOOLS[0]["function"]]}, "functions"),
])
def test_tool_requests_that_cannot_be_served_are_refused_by_name(client, body, param):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2,
                                       extra_body=body)
    assert error.value.body["param"] == param


def test_auto_needs_a_parser_and_llama3_json_reads_its_format():
    """Without --enable-auto-tool-choice, tools with the default choice ("auto") are refused as
    vLLM refuses them; a llama3_json server reads that format's calls."""
    reply = '\\{"name": "get_time", "parameters": \\{\\}\\}'
    with BackgroundServer(_serve(None).build_app()) as url:
        plain = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=120, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="enable-auto-tool-choice"):
            plain.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                          max_tokens=2)
    with BackgroundServer(_serve("llama3_json").build_app()) as url:
        llama = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=120, max_retries=0)
        choice = llama.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS,
                                               max_tokens=40,
                                               extra_body={"guided_regex": reply}).choices[0]
    assert choice.message.content is None and choice.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == \
        [("get_time", "{}")]
