"""The Responses API's output: items (reasoning, message, function_call) from a chat reply,
the response object around them, and the streamed event sequence (response.created, ...,
response.output_text.delta, ..., response.completed) from a reply's stream deltas."""

from __future__ import annotations

import itertools
import json
import secrets


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def reasoning_item(text: str, item_id: str | None = None, done: bool = True) -> dict:
    return {"type": "reasoning", "id": item_id or new_id("rs"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if done else [],
            "status": "completed" if done else "in_progress"}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, item_id: str | None = None, done: bool = True) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "role": "assistant",
            "status": "completed" if done else "in_progress",
            "content": [text_part(text)] if done else []}


def call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
              done: bool = True) -> dict:
    return {"type": "function_call", "id": item_id or new_id("fc"), "call_id": call_id,
            "name": name, "arguments": arguments,
            "status": "completed" if done else "in_progress"}


def output_items(message: dict) -> list[dict]:
    """A finished chat message as output items: its reasoning, its text, its calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or ():
        items.append(call_item(call["id"], call["function"]["name"],
                               call["function"]["arguments"]))
    return items


def assistant_turn(items: list[dict]) -> dict:
    """The output items as the chat message a follow-up's conversation holds."""
    text = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [{"id": i["call_id"], "type": "function",
              "function": {"name": i["name"], "arguments": i["arguments"]}}
             for i in items if i["type"] == "function_call"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls
                                                             else {})}


def status_of(finish_reason: str | None) -> tuple[str, dict | None]:
    """(status, incomplete_details) of a finished reply."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


class EventStream:
    """Translates one reply's stream deltas (pagedjax.serving.chat_replies) into Responses
    events, opening and closing one output item at a time; `items` are the items done."""

    def __init__(self) -> None:
        self._sequence = itertools.count()
        self.items: list[dict] = []
        self._open: dict | None = None  # {"kind", "id", "text", ...}

    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": next(self._sequence), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _opened(self) -> dict:
        """The item being streamed (_start opened it)."""
        assert self._open is not None, "no output item is open"
        return self._open

    def _where(self) -> dict:
        return {"item_id": self._opened()["id"], "output_index": len(self.items)}

    def _start(self, kind: str, item: dict) -> list[str]:
        out = self.close()
        self._open = {"kind": kind, "id": item["id"], "text": "", "item": item}
        out.append(self.event("response.output_item.added", output_index=len(self.items),
                              item=item))
        if kind == "message":
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=text_part("")))
        return out

    def feed(self, delta: dict) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            if self._open is None or self._open["kind"] != "reasoning":
                out += self._start("reasoning", reasoning_item("", done=False))
            self._opened()["text"] += delta["reasoning_content"]
            out.append(self.event("response.reasoning_text.delta", **self._where(),
                                  content_index=0, delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self._open is None or self._open["kind"] != "message":
                out += self._start("message", message_item("", done=False))
            self._opened()["text"] += delta["content"]
            out.append(self.event("response.output_text.delta", **self._where(),
                                  content_index=0, delta=delta["content"], logprobs=[]))
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a new call: its name first
                out += self._start("function_call", call_item(
                    call["id"], call["function"]["name"], "", done=False))
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                self._opened()["text"] += arguments
                out.append(self.event("response.function_call_arguments.delta",
                                      **self._where(), delta=arguments))
        return out

    def close(self) -> list[str]:
        """Ends the open item, if any."""
        if self._open is None:
            return []
        kind, text, item_id, where = (self._open["kind"], self._open["text"], self._open["id"],
                                      self._where())
        if kind == "reasoning":
            item = reasoning_item(text, item_id)
            out = [self.event("response.reasoning_text.done", **where, content_index=0,
                              text=text)]
        elif kind == "message":
            item = message_item(text, item_id)
            out = [self.event("response.output_text.done", **where, content_index=0, text=text,
                              logprobs=[]),
                   self.event("response.content_part.done", **where, content_index=0,
                              part=text_part(text))]
        else:
            opened = self._open["item"]
            item = call_item(opened["call_id"], opened["name"], text, item_id)
            out = [self.event("response.function_call_arguments.done", **where,
                              name=opened["name"], arguments=text)]
        out.append(self.event("response.output_item.done", output_index=len(self.items),
                              item=item))
        self.items.append(item)
        self._open = None
        return out
