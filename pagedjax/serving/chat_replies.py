"""A chat choice's reply from its text: the reasoning split off (pagedjax.serving.reasoning),
then the tool calls read from the answer (pagedjax.serving.tool_calls), as a whole message or
as a stream's deltas."""

from __future__ import annotations

from pagedjax.serving import reasoning as reasoning_lib, tool_calls
from pagedjax.serving.tool_calls import ToolRequest


class ReplyReader:
    """What a request's replies go through: its tool request (None: plain content, or tools
    with choice "none"), the server's tool and reasoning parsers, include_reasoning."""

    def __init__(self, tools: ToolRequest | None, tool_parser, reasoning_parser,
                 include_reasoning: bool):
        self.tools, self.tool_parser = tools, tool_parser
        self.reasoning, self.include_reasoning = reasoning_parser, include_reasoning

    def _answer(self, text: str) -> tuple[str | None, str]:
        if self.reasoning is None:
            return None, text
        reasoning, content, _ = self.reasoning.split(text, True)
        return reasoning, content

    def message(self, text: str, engine_reason: str | None) -> tuple[dict, str | None]:
        """(the finished reply's message, its finish_reason)."""
        reasoning, answer = self._answer(text)
        if self.tools is None:
            message = {"role": "assistant",
                       "content": answer if self.reasoning is None else (answer or None)}
            finish = engine_reason
        else:
            content, calls = tool_calls.parse_reply(self.tools, self.tool_parser, answer)
            message = tool_calls.reply_message(self.tools, content, calls)
            finish = tool_calls.finish_reason(self.tools, calls, engine_reason)
        if self.include_reasoning:
            message.update(reasoning_lib.fields(reasoning))
        return message, finish

    def finish_reason(self, text: str, engine_reason: str | None) -> str | None:
        return self.message(text, engine_reason)[1] if self.tools is not None else engine_reason

    def stream(self) -> "ReplyStream":
        return ReplyStream(self)


class ReplyStream:
    """One streamed choice: feed it the choice's text so far, get the deltas to send."""

    def __init__(self, reader: ReplyReader):
        self.reasoning = None if reader.reasoning is None else reasoning_lib.ReasoningStream(
            reader.reasoning, reader.include_reasoning)
        self.tools = None if reader.tools is None else tool_calls.ToolStream(
            reader.tools, reader.tool_parser)
        self.sent = 0  # characters of the answer sent as content

    def feed(self, text: str, finished: bool) -> list[dict]:
        deltas: list[dict] = []
        answer, ready = text, True
        if self.reasoning is not None:
            deltas, answer, ready = self.reasoning.feed(text, finished)
        if not ready:
            return deltas
        if self.tools is not None:
            return deltas + self.tools.feed(answer, finished)
        new, self.sent = answer[self.sent:], max(self.sent, len(answer))
        return deltas + ([{"content": new}] if new else [])
