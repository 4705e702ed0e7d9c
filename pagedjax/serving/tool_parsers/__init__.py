"""Tool-call parsers for `tool_choice: "auto"` (`pagedjax serve --enable-auto-tool-choice
--tool-call-parser NAME`, as vLLM's): each reads the calls a model family writes in its text.

A parser is one small module with a ToolParser subclass, registered here by its vLLM name:

- extract(text) -> (content or None, [Call]): the finished reply's text before the calls and the
  calls; a reply whose calls do not parse is content, whole;
- held(text) -> int: while streaming, how many leading characters of the text so far are
  surely content (the rest may be the start of a call and waits: no partial tag leaks);
- calls_so_far(text) -> [Call]: the calls already complete in the text so far (streamed as they
  close; the rest at the end, from extract).
"""

from __future__ import annotations

from pagedjax.serving.tool_parsers.base import Call, ToolParser
from pagedjax.serving.tool_parsers.hermes import HermesParser
from pagedjax.serving.tool_parsers.llama3_json import Llama3JsonParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,  # <tool_call>{"name", "arguments"}</tool_call>: ChatML, Qwen 2/2.5/3
    "llama3_json": Llama3JsonParser,  # {"name", "parameters"} (; ...): Llama 3.1 / 3.2 JSON
}


def get_parser(name: str) -> ToolParser:
    """The parser registered as name; ValueError naming the choices."""
    if name not in PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(sorted(PARSERS))}, "
                         f"got {name!r}")
    return PARSERS[name]()


__all__ = ["PARSERS", "Call", "ToolParser", "get_parser"]
