"""The tool-call parsers (pagedjax.serving.tool_parsers) on text, finished and streamed: what they
read as calls, what stays content, and that nothing that may start a call is streamed as
content."""

from __future__ import annotations

import json

import pytest

from pagedjax.serving.tool_parsers import PARSERS, Call, get_parser

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_hermes_reads_blocks_after_content():
    parser = get_parser("hermes")
    text = f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n" \
           '{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
    content, calls = parser.extract(text)
    assert content == "Let me check."
    assert calls == [Call("get_weather", '{"city": "Paris"}'), Call("get_time", '{"zone": "CET"}')]
    assert parser.extract(f"<tool_call>{WEATHER}")[1] == [Call("get_weather",
                                                              '{"city": "Paris"}')]  # unclosed end
    for broken in ("<tool_call>{not json}</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                   "no calls here", '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'):
        assert parser.extract(broken) == (broken, [])  # the reply is content, whole


def test_hermes_streams_no_partial_tag_and_calls_as_they_close():
    parser = get_parser("hermes")
    text = f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>"
    for end in range(len(text) + 1):
        prefix = text[:end]
        # the content as soon as it is known, never a piece of the tag
        assert parser.held(prefix) == min(end, len("Sure.\n"))
        done = parser.calls_so_far(prefix)
        assert done == ([Call("get_weather", '{"city": "Paris"}')] if prefix == text else [])
    assert parser.held("a <tool") == 2 and parser.held("a < b") == 5


def test_llama3_json_reads_one_or_several_calls():
    parser = get_parser("llama3_json")
    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert parser.extract(one) == (None, [Call("get_weather", '{"city": "Paris"}')])
    two = f'<|python_tag|>{one}; {{"name": "get_time", "parameters": {{}}}}'
    assert [c.name for c in parser.extract(two)[1]] == ["get_weather", "get_time"]
    # Not calls, or cut short (max_tokens) after whole calls too: the reply is content, whole
    # (issue 57: a truncated second call dropping the text passed every test).
    for content in ("Paris is sunny.", '{"name": "x", "parameters": ', "{} trailing",
                    f'{one}; {{"name": "get_time", "param', f"<|python_tag|>{one};{one[:-1]}"):
        assert parser.extract(content) == (content, [])
    assert parser.held("  {") == 0 and parser.held("<|python") == 0
    assert parser.held("Hello") == 5


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_parser_round_trips_its_own_format(name):
    arguments = {"city": "Zürich", "days": [1, 2]}
    written = {"hermes": f'<tool_call>\n{{"name": "f", "arguments": {json.dumps(arguments)}}}\n'
                         f'</tool_call>',
               "llama3_json": f'{{"name": "f", "parameters": {json.dumps(arguments)}}}'}[name]
    _, calls = get_parser(name).extract(written)
    assert [c.name for c in calls] == ["f"] and json.loads(calls[0].arguments) == arguments


def test_unknown_parser_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="hermes, llama3_json"):
        get_parser("mistral")
