"""The Responses API's request body and its translation to a chat request: `input` items
become messages (function calls an assistant turn's tool_calls, their outputs tool turns),
`instructions` the system turn, flat function tools and `text.format` chat's tools and
response_format, `max_output_tokens` max_tokens, `reasoning.effort` reasoning_effort."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from pagedjax.serving.http_common import APIError
from pagedjax.serving.protocol import REASONING_EFFORTS, ChatCompletionRequest, Identifier
from pagedjax.serving.tool_calls import call_arguments

# Errors of the chat request name chat's fields; these are their Responses names.
PARAM_NAMES = {"messages": "input", "max_tokens": "max_output_tokens",
               "response_format": "text", "reasoning_effort": "reasoning",
               "top_logprobs": "top_logprobs"}
VLLM_EXTENSIONS = ("presence_penalty", "frequency_penalty", "logit_bias", "stop", "ignore_eos",
                   "skip_special_tokens", "include_stop_str_in_output", "include_reasoning",
                   "structured_outputs", "cache_salt", "chat_template_kwargs", "priority")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class ResponsesRequest(BaseModel):
    """POST /v1/responses (OpenAI's fields this server serves; the rest are refused by name)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(...)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: Identifier = None
    safety_identifier: Identifier = None
    prompt_cache_key: Identifier = None
    service_tier: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    max_tool_calls: int | None = None
    # vLLM's extensions of the Responses request, served as on chat
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    include_reasoning: bool = True
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    priority: int = 0

    def unsupported(self) -> list[tuple[str, str]]:
        found = []
        if self.truncation not in (None, "disabled"):
            found.append(("truncation", "truncation must be \"disabled\": a conversation longer "
                          "than the context is refused, never cut"))
        if self.include:
            found.append(("include", "include: no extra output data is served (no encrypted "
                          "reasoning, no logprobs on output_text)"))
        if self.text is not None and set(self.text) - {"format", "verbosity"}:
            found.append(("text", "text holds format only"))
        if self.text is not None and self.text.get("verbosity") not in (None, "medium"):
            found.append(("text", "text.verbosity cannot be honoured: only \"medium\""))
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and effort not in REASONING_EFFORTS:
            found.append(("reasoning", f"reasoning.effort must be one of "
                          f"{', '.join(REASONING_EFFORTS)}"))
        if self.reasoning is not None and set(self.reasoning) - {"effort", "summary"}:
            found.append(("reasoning", "reasoning holds effort and summary only"))
        if self.max_tool_calls is not None:
            found.append(("max_tool_calls", "max_tool_calls is not served (a reply's calls are "
                          "not cut; use parallel_tool_calls: false for one)"))
        if self.top_logprobs:
            found.append(("top_logprobs", "top_logprobs is not served on /v1/responses (use "
                          "/v1/chat/completions)"))
        return found


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}.content: only text parts (input_text, output_text) "
                           "are served", "input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(items: str | list[dict]) -> list[dict]:
    """The chat messages of a request's input items (APIError 400 naming input)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(400, f"{where}.role must be user, assistant, system or developer",
                               "input")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise APIError(400, f"{where}: a function_call needs call_id, name and "
                               "arguments (strings)", "input")
            call_arguments(item["arguments"], f"{where}.arguments", "input")  # JSON, or 400
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}: a function_call_output needs its call_id", "input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _text(output, where) if not isinstance(output, str)
                             else output})
        elif kind == "reasoning":
            continue  # earlier turns' reasoning: chat templates do not render it either
        else:
            raise APIError(400, f"{where}: items of type {str(kind)[:40]!r} are not served "
                           "(message, function_call, function_call_output, reasoning)", "input")
    if not messages:
        raise APIError(400, "input holds no message", "input")
    return messages


def _tools(tools: list[dict] | None) -> list[dict] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools[{i}]: only function tools are served, got "
                           f"{str(tool.get('type'))[:40]!r}", "tools")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    return out


def _tool_choice(choice):
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict | None) -> dict | None:
    spec = (text or {}).get("format")
    if spec is None or spec.get("type") in ("text", "json_object"):
        return spec
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            k: spec[k] for k in ("name", "schema", "strict", "description") if k in spec}}
    raise APIError(400, "text.format.type must be text, json_object or json_schema", "text")


def chat_request(body: ResponsesRequest, history: list[dict]
                 ) -> tuple[ChatCompletionRequest, list[dict]]:
    """(the chat request a Responses request runs as, the conversation a follow-up continues);
    history: the stored conversation of previous_response_id (its instructions not carried
    over, as OpenAI)."""
    for field, why in body.unsupported():
        raise APIError(400, why, field)
    conversation = history + input_messages(body.input)
    messages = conversation
    if body.instructions is not None:
        messages = [{"role": "system", "content": body.instructions}] + messages
    fields = {"model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
              "min_p": body.min_p, "seed": body.seed,
              "repetition_penalty": body.repetition_penalty,
              "tools": _tools(body.tools), "tool_choice": _tool_choice(body.tool_choice),
              "parallel_tool_calls": body.parallel_tool_calls,
              "response_format": _response_format(body.text),
              "reasoning_effort": (body.reasoning or {}).get("effort"),
              "metadata": body.metadata, "user": body.user,
              "safety_identifier": body.safety_identifier,
              "prompt_cache_key": body.prompt_cache_key, "service_tier": body.service_tier,
              "stream": body.stream,
              **{name: getattr(body, name) for name in VLLM_EXTENSIONS}}
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in fields.items() if v is not None}), conversation
    except ValueError as e:  # a message or tool the chat request's model refuses
        raise APIError(400, f"input: {str(e).splitlines()[0][:200]}", "input") from None
