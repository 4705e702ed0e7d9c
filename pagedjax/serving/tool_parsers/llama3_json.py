"""Llama 3.1 / 3.2 JSON tool calls: the reply is `{"name": ..., "parameters": {...}}`, several
separated by `;`, optionally after `<|python_tag|>`; a reply that does not start so is content."""

from __future__ import annotations

import json

from pagedjax.serving.tool_parsers.base import Call, ToolParser, call_from_json

PYTHON_TAG = "<|python_tag|>"


def _body(text: str) -> str | None:
    """The text after the tag and leading whitespace, when it may be calls; else None."""
    stripped = text.lstrip()
    if stripped.startswith(PYTHON_TAG):
        return stripped[len(PYTHON_TAG):].lstrip()
    return stripped if stripped.startswith("{") else None


class Llama3JsonParser(ToolParser):
    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        body = _body(text)
        if body is None:
            return text, []
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except json.JSONDecodeError:
                return text, []
            call = call_from_json(obj)
            if call is None:
                return text, []
            calls.append(call)
            at = end
            while at < len(body) and body[at] in " \t\r\n;":
                at += 1
        return (None, calls) if calls else (text, [])

    def held(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped[:len(PYTHON_TAG)]) or \
                stripped.startswith("{"):
            return 0  # maybe calls: known at the end
        return len(text)

    def calls_so_far(self, text: str) -> list[Call]:
        return []  # a call's end is known only at the reply's
