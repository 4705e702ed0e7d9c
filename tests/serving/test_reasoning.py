"""Reasoning output (--reasoning-parser deepseek_r1 / qwen3): the split of a thinking model's
reply into reasoning and answer, finished and streamed (no piece of a tag sent as either), and
through a real server with the openai client (the reply forced with guided_regex, as a
thinking model writes it), tool calls read from the answer only."""

from __future__ import annotations

import openai
import pytest
from test_tool_calls import ASK, TOOLS, _serve

from pagedjax.serving.background import BackgroundServer
from pagedjax.serving.reasoning import END, START, get_parser

# Clients driving a real server: run by make test-clients (and CI), beside the client suite,
# to keep make test within its time.
pytestmark = pytest.mark.clients


@pytest.mark.parametrize("name, text, reasoning, content", [
    ("qwen3", "<think>\nplan\n</think>\n\nAnswer", "\nplan\n", "\n\nAnswer"),
    ("qwen3", "Answer without thinking", "", "Answer without thinking"),
    ("qwen3", "<think>cut by max_tokens", "cut by max_tokens", ""),
    ("deepseek_r1", "plan</think>Answer", "plan", "Answer"),
    ("deepseek_r1", "<think>plan</think>Answer", "plan", "Answer"),
    ("deepseek_r1", "still thinking", "still thinking", ""),
])
def test_split_of_a_finished_reply(name, text, reasoning, content):
    assert get_parser(name).split(text, True)[:2] == (reasoning, content)


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_streamed_split_never_sends_a_piece_of_a_tag(name):
    text = f"{START}step one, step two{END}The answer."
    parser = get_parser(name)
    final_reasoning, final_content, _ = parser.split(text, True)
    for end in range(len(text) + 1):
        reasoning, content, ready = parser.split(text[:end], False)
        assert final_reasoning.startswith(reasoning) and "<" not in reasoning
        assert not ready or final_content.startswith(content)
        assert ready == (end >= text.index(END) + len(END))


@pytest.fixture(scope="module")
def urls():
    servers = {name: _serve("hermes") for name in ("qwen3", "deepseek_r1")}
    for name, server in servers.items():
        server.reasoning_parser = get_parser(name)
    with BackgroundServer(servers["qwen3"].build_app()) as qwen, \
            BackgroundServer(servers["deepseek_r1"].build_app()) as r1:
        yield {"qwen3": qwen, "deepseek_r1": r1}


def _client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", timeout=120, max_retries=0)


def _streamed(client, **body):
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return reasoning, content, finish


@pytest.mark.parametrize("name, forced", [
    ("qwen3", "<think>\nweigh it\n</think>\n\nRome"),
    ("deepseek_r1", "weigh it</think>Rome"),
])
def test_served_reasoning_whole_and_streamed(urls, name, forced):
    client = _client(urls[name])
    regex = forced.replace("\n", "\\n")
    body = dict(model="tiny", messages=ASK, max_tokens=60,
                extra_body={"guided_regex": regex})
    whole = client.chat.completions.create(**body).choices[0]
    expected = get_parser(name).split(forced, True)
    assert whole.message.model_extra["reasoning_content"] == expected[0]
    assert whole.message.model_extra["reasoning"] == expected[0]
    assert whole.message.content == expected[1]
    assert _streamed(client, **body) == (expected[0], expected[1], "stop")
    hidden = client.chat.completions.create(**{**body, "extra_body": {
        "guided_regex": regex, "include_reasoning": False}}).choices[0]
    assert "reasoning_content" not in (hidden.message.model_extra or {})
    assert hidden.message.content == expected[1]


def test_tool_calls_are_read_from_the_answer_not_the_reasoning(urls):
    client = _client(urls["qwen3"])
    call = '<tool_call>\\n\\{"name": "get_time", "arguments": \\{\\}\\}\\n</tool_call>'
    regex = f"<think>I could write {call} here</think>\\n{call}"
    body = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=200,
                extra_body={"guided_regex": regex})
    choice = client.chat.completions.create(**body).choices[0]
    assert choice.message.model_extra["reasoning_content"].startswith("I could write <tool_call>")
    assert [c.function.name for c in choice.message.tool_calls] == ["get_time"]
    assert choice.finish_reason == "tool_calls"
    reasoning, content, finish = _streamed(client, **body)
    assert reasoning.startswith("I could write <tool_call>") and "<" not in content
    assert finish == "tool_calls"
