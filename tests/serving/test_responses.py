"""The Responses API (POST /v1/responses, GET / DELETE /v1/responses/{id}, cancel) through the
official openai client against a real server, on the byte model with the ChatML tool template:
text replies whole and streamed (the event sequence), previous_response_id continuing a stored
conversation, function calls and their outputs as input items, text.format structured output,
background responses polled and cancelled, the store off, and refusals by name. Replies are
forced with vLLM's structured_outputs extension where the test needs known text."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from test_tool_calls import CITY, TOOLS, _serve

from pagedjax.serving.background import BackgroundServer
from pagedjax.text.tokenizer import read_chat_template, render_chat_template

# Clients driving a real server: run by make test-clients (and CI), beside the client suite,
# to keep make test within its time.
pytestmark = pytest.mark.clients

FUNCTIONS = [{"type": "function", "name": t["function"]["name"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]
HELLO = {"structured_outputs": {"regex": "Hello there"}}
TEMPLATE = read_chat_template("tool_chatml")


@pytest.fixture(scope="module")
def served():
    server = _serve(None)
    with BackgroundServer(server.build_app()) as url:
        yield server, openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=120,
                                    max_retries=0)


def _prompt_tokens(messages, tools=None) -> int:
    return len(render_chat_template(TEMPLATE, messages, True, tools=tools).encode())


def test_a_text_reply_is_stored_and_continued(served):
    _, client = served
    first = client.responses.create(model="tiny", input="Say hello", instructions="Be kind.",
                                    max_output_tokens=20, extra_body=HELLO)
    assert first.status == "completed" and first.output_text == "Hello there"
    assert [item.type for item in first.output] == ["message"]
    assert first.id.startswith("resp_") and first.instructions == "Be kind."
    assert first.usage.input_tokens == _prompt_tokens([
        {"role": "system", "content": "Be kind."}, {"role": "user", "content": "Say hello"}])
    assert first.usage.output_tokens == first.usage.total_tokens - first.usage.input_tokens
    assert client.responses.retrieve(first.id).output_text == "Hello there"
    # The follow-up: the stored turns, then the new input; the instructions are not carried.
    second = client.responses.create(model="tiny", input="Again", previous_response_id=first.id,
                                     max_output_tokens=20, extra_body=HELLO)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == _prompt_tokens([
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "Hello there"}, {"role": "user", "content": "Again"}])


def test_the_streamed_event_sequence(served):
    _, client = served
    with client.responses.stream(model="tiny", input="Say hello", max_output_tokens=20,
                                 extra_body=HELLO) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        "Hello there"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "Hello there"
    assert client.responses.retrieve(final.id).output[0].id == final.output[0].id


def test_function_calls_and_their_outputs(served):
    _, client = served
    body = dict(model="tiny", input="Weather in Rome?", tools=FUNCTIONS,
                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                temperature=0, extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    called = client.responses.create(**body)
    call, = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    with client.responses.stream(**body) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "get_weather" and json.loads(done.arguments) == json.loads(call.arguments)
    answer = client.responses.create(
        model="tiny", previous_response_id=called.id, tools=FUNCTIONS, tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "25C"}],
        max_output_tokens=20, extra_body=HELLO)
    assert answer.output_text == "Hello there"
    assert answer.usage.input_tokens == _prompt_tokens([
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {
            "name": "get_weather", "arguments": json.loads(call.arguments)}}]},
        {"role": "tool", "content": "25C"}], tools=[{"type": "function", "function": {
            "name": f["name"], "parameters": f["parameters"]}} for f in FUNCTIONS])


def test_text_format_json_schema(served):
    _, client = served
    reply = client.responses.create(model="tiny", input="A city", max_output_tokens=60,
                                    temperature=0, text={"format": {
                                        "type": "json_schema", "name": "city", "schema": CITY}},
                                    extra_body={"structured_outputs": {
                                        "disable_any_whitespace": True}})
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), CITY)


def test_background_responses_are_polled_and_cancelled(served):
    server, client = served
    queued = client.responses.create(model="tiny", input="Say hello", background=True,
                                     max_output_tokens=20, extra_body=HELLO)
    assert queued.status == "queued"
    deadline = time.monotonic() + 60
    while client.responses.retrieve(queued.id).status in ("queued", "in_progress") \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.responses.retrieve(queued.id).output_text == "Hello there"
    server.async_engine.pause()  # held in flight until cancelled
    try:
        long = client.responses.create(model="tiny", input="Go on", background=True,
                                       max_output_tokens=300, extra_body={"ignore_eos": True})
        assert client.responses.cancel(long.id).status == "cancelled"
    finally:
        server.async_engine.resume()
    deadline = time.monotonic() + 60
    while server.engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.engine.has_unfinished()  # its request was aborted, its blocks freed
    assert client.responses.cancel(queued.id).status == "completed"  # over: as it ended
    plain = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only background"):
        client.responses.cancel(plain.id)
    client.responses.delete(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(queued.id)


def test_store_false_and_a_server_without_a_store():
    server = _serve(None)
    server.responses.max_entries = 0
    with BackgroundServer(server.build_app()) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=120, max_retries=0)
        plain = client.responses.create(model="tiny", input="hi", max_output_tokens=2)
        assert plain.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(plain.id)
        for field, value in (("store", True), ("previous_response_id", plain.id),
                             ("background", True)):
            with pytest.raises(openai.BadRequestError) as error:
                client.responses.create(model="tiny", input="hi", max_output_tokens=2,
                                        **{field: value})
            assert error.value.body["param"] == field


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"previous_response_id": "resp_nope"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"user": "u" * 65}, "user"),  # OpenAI's bound on its identifiers: 64 characters
    ({"safety_identifier": "s" * 65}, "safety_identifier"),
    ({"prompt_cache_key": "k" * 65}, "prompt_cache_key"),
])
def test_requests_that_cannot_be_served_are_refused_by_name(served, body, param):
    _, client = served
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model="tiny", input="hi", extra_body=body)
    assert error.value.body["param"] == param


def test_input_items_become_chat_turns():
    """Consecutive function calls are one assistant turn's tool_calls, each output a tool turn,
    developer a system turn; earlier reasoning items are not rendered (as chat templates drop
    it)."""
    from pagedjax.serving.responses_input import input_messages
    call = {"type": "function_call", "name": "get_time", "arguments": "{}"}
    messages = input_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Time"},
                                     {"type": "input_text", "text": "s?"}]},
        {"type": "reasoning", "summary": []},
        {**call, "call_id": "a"}, {**call, "call_id": "b"},
        {"type": "function_call_output", "call_id": "a", "output": "9:00"},
        {"type": "function_call_output", "call_id": "b", "output": "10:00"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "9 and 10."}]}])
    assert messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Times?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": i, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
            for i in "ab"]},
        {"role": "tool", "tool_call_id": "a", "content": "9:00"},
        {"role": "tool", "tool_call_id": "b", "content": "10:00"},
        {"role": "assistant", "content": "9 and 10."}]
