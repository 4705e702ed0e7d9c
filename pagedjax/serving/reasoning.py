"""Reasoning output (`pagedjax serve --reasoning-parser NAME`, vLLM's): a thinking model's
`<think>...</think>` is split from its answer into `message.reasoning_content` (also as
`reasoning`, vLLM's newer name), streamed as deltas of its own; the answer is `content` (and what
tool calls are read from). vLLM's `include_reasoning: false` leaves the reasoning out.

- deepseek_r1: the template opens the thinking, so the reply is reasoning until `</think>` (a
  leading `<think>` dropped); a reply that never closes it is all reasoning.
- qwen3: the reply thinks only when it starts with `<think>` (thinking can be switched off, e.g.
  `chat_template_kwargs: {"enable_thinking": false}`); otherwise it is all content.

Streamed, nothing that may be the start of a tag is sent until it is known not to be one.
"""

from __future__ import annotations

import dataclasses

from pagedjax.serving.tool_parsers.base import held_back

START, END = "<think>", "</think>"


@dataclasses.dataclass(frozen=True)
class ReasoningParser:
    name: str
    opens_itself: bool  # the reply starts the thinking with START (qwen3) or is in it (r1)

    def split(self, text: str, finished: bool) -> tuple[str, str, bool]:
        """(reasoning, content, whether the content is known to follow) of the reply so far;
        unfinished, only what is surely each (a possible tag's start held back)."""
        stripped = text.lstrip()
        if not finished and START.startswith(stripped):  # maybe the opening tag: wait
            return "", "", False
        thinking = stripped.startswith(START)
        if self.opens_itself and not thinking:
            return "", text, True
        body = stripped[len(START):] if thinking else text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END):], True
        if finished:
            return body, "", True
        return body[:held_back(body, END)], "", False


PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", opens_itself=False),
           "qwen3": ReasoningParser("qwen3", opens_itself=True)}


def get_parser(name: str) -> ReasoningParser:
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {', '.join(sorted(PARSERS))}, "
                         f"got {name!r}")
    return PARSERS[name]


def fields(reasoning: str | None) -> dict:
    """A message's or delta's reasoning, under both of vLLM's names."""
    return {} if not reasoning else {"reasoning_content": reasoning, "reasoning": reasoning}


class ReasoningStream:
    """One streamed choice's reasoning deltas; `content` is the answer so far for the next
    stage (plain content or a ToolStream)."""

    def __init__(self, parser: ReasoningParser, include: bool):
        self.parser, self.include = parser, include
        self.sent = 0

    def feed(self, text: str, finished: bool) -> tuple[list[dict], str, bool]:
        """(reasoning deltas, the content so far, whether content may be sent)."""
        reasoning, content, ready = self.parser.split(text, finished)
        new, self.sent = reasoning[self.sent:], max(self.sent, len(reasoning))
        deltas = [fields(new)] if new and self.include else []
        return deltas, content, ready
