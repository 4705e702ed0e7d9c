"""Hermes / Qwen tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
block a call, after any content (the ChatML tool template pagedjax ships asks for this)."""

from __future__ import annotations

import json
import re

from pagedjax.serving.tool_parsers.base import Call, ToolParser, call_from_json, held_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


def _calls(region: str, closed_only: bool) -> list[Call] | None:
    """The calls of the text from the first OPEN on; None when one does not parse."""
    calls = []
    for match in _BLOCK.finditer(region):
        if closed_only and not match.group(0).endswith(CLOSE):
            break
        try:
            call = call_from_json(json.loads(match.group(1)))
        except json.JSONDecodeError:
            return None
        if call is None:
            return None
        calls.append(call)
    return calls


class HermesParser(ToolParser):
    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        start = text.find(OPEN)
        if start < 0:
            return text, []
        calls = _calls(text[start:], closed_only=False)
        if not calls:
            return text, []  # not calls after all: the text is the reply
        content = text[:start].rstrip()
        return (content or None), calls

    def held(self, text: str) -> int:
        start = text.find(OPEN)
        return start if start >= 0 else held_back(text, OPEN)

    def calls_so_far(self, text: str) -> list[Call]:
        start = text.find(OPEN)
        return [] if start < 0 else (_calls(text[start:], closed_only=True) or [])
