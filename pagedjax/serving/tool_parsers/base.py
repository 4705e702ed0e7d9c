"""What every tool-call parser shares: the Call it returns and the JSON reading of one call."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # a JSON object, as OpenAI sends it (a string)


def call_from_json(obj, arguments_keys=("arguments", "parameters")) -> Call | None:
    """A Call from a decoded {"name": str, "arguments" | "parameters": object}, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    arguments: object = next((obj[k] for k in arguments_keys if k in obj), {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return Call(obj["name"], json.dumps(arguments, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """How many characters of text are surely not the start of marker: all of it but its
    longest suffix that is a prefix of marker."""
    for keep in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


class ToolParser:
    """See pagedjax.serving.tool_parsers."""

    def extract(self, text: str) -> tuple[str | None, list[Call]]:
        raise NotImplementedError

    def held(self, text: str) -> int:
        raise NotImplementedError

    def calls_so_far(self, text: str) -> list[Call]:
        raise NotImplementedError
