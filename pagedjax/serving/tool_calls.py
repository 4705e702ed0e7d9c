"""Tool calling on /v1/chat/completions, as vLLM serves it.

- `tools` (OpenAI's function tools) go to the chat template; the template writes them into the
  prompt (SmolLM2's knows no tools: `pagedjax serve --chat-template tool_chatml` ships one).
- `tool_choice`: "none" (the tools are shown, no call is parsed), "auto" (the default with
  tools: the reply is read by the --tool-call-parser, enabled by --enable-auto-tool-choice),
  "required" (the reply is constrained by structured outputs to a JSON list of calls of the
  given tools, at least one; `parallel_tool_calls: false` makes it exactly one) or a named
  function (the reply is constrained to its parameters' schema: it is the call's arguments).
- The reply: `message.tool_calls` (ids `call_...`) and `finish_reason: "tool_calls"` ("stop" for
  a named choice, as OpenAI); streamed, each call's name first, then its arguments.
- OpenAI's deprecated `functions` / `function_call` are the same, answered in their own shape
  (`message.function_call`, finish_reason "function_call").
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from pagedjax.serving.http_common import APIError
from pagedjax.serving.tool_parsers import Call, ToolParser
from pagedjax.serving.tool_parsers.base import call_from_json

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
CHOICES = ("none", "auto", "required")
AUTO_NEEDS_PARSER = ('"auto" tool choice needs the server started with --enable-auto-tool-'
                     'choice and --tool-call-parser (as vLLM); send tool_choice "required", '
                     'a named function or "none"')


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...]  # {"type": "function", "function": {"name", ...}}
    choice: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the named function
    parallel: bool = True
    legacy: bool = False  # functions / function_call: answered as message.function_call
    field: str = "tools"  # the body's field, for errors

    @property
    def function(self) -> str:
        """The function a named choice names."""
        if self.name is None:
            raise ValueError(f"tool choice {self.choice!r} names no function")
        return self.name

    def schema(self) -> dict | None:
        """The JSON schema a required or named choice constrains the reply to."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                  for t in self.tools}
        if self.choice == "named":
            return params[self.name]
        if self.choice != "required":
            return None
        items = {"anyOf": [{"type": "object", "properties": {
            "name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"], "additionalProperties": False}
            for name, schema in params.items()]}
        return {"type": "array", "minItems": 1, "items": items,
                **({} if self.parallel else {"maxItems": 1})}


def _check_tools(tools, field: str) -> tuple[dict, ...]:
    if not tools:
        raise APIError(400, f"{field} must be a non-empty list", field)
    for i, tool in enumerate(tools):
        function = tool.get("function") if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict):
            raise APIError(400, f"{field}[{i}]: only function tools ({{'type': 'function', "
                           f"'function': {{...}}}}) are served", field)
        name, parameters = function.get("name"), function.get("parameters")
        if not isinstance(name, str) or not NAME.match(name):
            raise APIError(400, f"{field}[{i}].function.name must be 1 to 64 letters, digits, "
                           f"'_', '-' or '.'", field)
        if parameters is not None and not isinstance(parameters, dict):
            raise APIError(400, f"{field}[{i}].function.parameters must be a JSON schema "
                           f"object", field)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, f"{field}: function names must be distinct", field)
    return tuple({"type": "function", "function": t["function"]} for t in tools)


def tool_request(body, parser: ToolParser | None) -> ToolRequest | None:
    """The body's tools and choice, checked (APIError 400 naming the field), or None."""
    legacy = body.functions is not None or body.function_call is not None
    if legacy and (body.tools is not None or body.tool_choice is not None):
        raise APIError(400, "functions / function_call are the deprecated spelling of tools / "
                       "tool_choice: send one pair", "functions")
    field, choice_field = ("functions", "function_call") if legacy else ("tools", "tool_choice")
    if legacy:
        tools = None if body.functions is None else [{"type": "function", "function": f}
                                                     for f in body.functions]
        choice = body.function_call
    else:
        tools, choice = body.tools, body.tool_choice
    if not tools:  # an empty list is no tools (OpenAI's Responses clients send one)
        if choice not in (None, "none"):
            raise APIError(400, f"{choice_field} needs {field}", choice_field)
        return None
    checked = _check_tools(tools, field)
    if choice is None:
        choice = "auto"
    name = None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if not legacy else choice.get("name")
        if not isinstance(name, str) or name not in {t["function"]["name"] for t in checked}:
            raise APIError(400, f"{choice_field} names no function of {field}", choice_field)
        choice = "named"
    elif choice not in CHOICES or legacy and choice == "required":
        raise APIError(400, f"{choice_field} must be {', '.join(CHOICES[:2 + (not legacy)])} "
                       f"or a named function", choice_field)
    if choice == "auto" and parser is None:
        raise APIError(400, AUTO_NEEDS_PARSER, choice_field)
    return ToolRequest(checked, choice, name, body.parallel_tool_calls, legacy, field)


def call_arguments(value, where: str, param: str):
    """An earlier assistant turn's tool call arguments as chat templates read them (vLLM's
    rule): JSON text parsed, nothing (None, "") an empty object, a parsed value as it is. Text
    that is not JSON, or nested deeper than the parser reads, is refused (400) by where."""
    if value is None or value == "":
        return {}
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else "not valid JSON"
        raise APIError(400, f"{where} is {why}", param) from None


def _call_json(call: Call, index: int, legacy: bool) -> dict:
    if legacy:
        return {"name": call.name, "arguments": call.arguments}
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function", "index": index,
            "function": {"name": call.name, "arguments": call.arguments}}


def _required_calls(text: str) -> list[Call] | None:
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = [call_from_json(item, ("parameters",)) for item in items]
    parsed = [call for call in calls if call is not None]
    return parsed if len(parsed) == len(calls) else None


def auto_parser(parser: ToolParser | None) -> ToolParser:
    """The server's tool parser, which tool_choice "auto" needs (tool_request refuses it
    without one)."""
    if parser is None:
        raise ValueError(AUTO_NEEDS_PARSER)
    return parser


def parse_reply(req: ToolRequest, parser: ToolParser | None,
                text: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of a finished reply; a reply whose calls do not parse (cut by
    max_tokens, say) is content."""
    if req.choice == "named":
        return None, [Call(req.function, text)]
    if req.choice == "required":
        calls = _required_calls(text)
        return (text, []) if calls is None else (None, calls)
    if req.choice == "auto":
        content, calls = auto_parser(parser).extract(text)
        return content, calls if req.parallel else calls[:1]
    return text, []


def reply_message(req: ToolRequest, content: str | None, calls: list[Call]) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls and req.legacy:
        message["function_call"] = _call_json(calls[0], 0, True)
    elif calls:
        message["tool_calls"] = [{k: v for k, v in _call_json(c, i, False).items()
                                  if k != "index"} for i, c in enumerate(calls)]
    return message


def finish_reason(req: ToolRequest, calls: list[Call], engine_reason: str | None) -> str | None:
    if not calls or engine_reason not in ("stop", None) or req.choice == "named":
        return engine_reason
    return "function_call" if req.legacy else "tool_calls"


class ToolStream:
    """One streamed choice's deltas under a tool request: feed it the choice's text so far,
    get the delta dicts to send (content as it is known to be content; each call's name, then
    its arguments, as the call completes; the rest at the end)."""

    def __init__(self, req: ToolRequest, parser: ToolParser | None):
        self.req, self.parser = req, parser
        self.sent_content = 0  # characters of text sent as content
        self.sent_calls = 0
        self.sent_named_args = 0

    def _call_deltas(self, calls: list[Call]) -> list[dict]:
        out: list[dict[str, Any]] = []
        for call in calls[self.sent_calls:]:
            if self.req.legacy:
                out.append({"function_call": {"name": call.name, "arguments": ""}})
                if call.arguments:
                    out.append({"function_call": {"arguments": call.arguments}})
            else:
                out.append({"tool_calls": [_call_json(Call(call.name, ""), self.sent_calls,
                                                      False)]})
                if call.arguments:
                    out.append({"tool_calls": [{"index": self.sent_calls,
                                                "function": {"arguments": call.arguments}}]})
            self.sent_calls += 1
        return out

    def feed(self, text: str, finished: bool) -> list[dict]:
        req = self.req
        if req.choice == "named":  # the reply is the arguments: the name first, then them
            out = [] if self.sent_calls else self._call_deltas([Call(req.function, "")])
            new = text[self.sent_named_args:]
            self.sent_named_args = len(text)
            if new:
                key = "function_call" if req.legacy else "tool_calls"
                fragment = {"arguments": new}
                out.append({key: fragment} if req.legacy else {key: [
                    {"index": 0, "function": fragment}]})
            return out
        if not finished:
            if req.choice == "required":
                return []  # a JSON list: read at the end
            parser = auto_parser(self.parser)
            calls = parser.calls_so_far(text)
            return self._content(text[:parser.held(text)]) + self._call_deltas(
                calls if req.parallel else calls[:1])
        content, calls = parse_reply(req, self.parser, text)
        if not calls:
            return self._content(text)
        return self._content(content or "") + self._call_deltas(calls)

    def _content(self, text: str) -> list[dict]:
        new = text[self.sent_content:]
        if not new or self.sent_calls:
            return []
        self.sent_content = len(text)
        return [{"content": new}]
