"""The wire format of the OpenAI-compatible endpoints: pydantic request bodies.

Bodies are parsed strictly (no string-to-number coercion, no booleans for integers) and unknown
fields are refused by name: a field a client sends is served or refused, never dropped. Limits
that depend on the engine (n against max_num_seqs, top_k against the vocabulary, ...) are the
engine's admission path's (pagedjax.engine.request_checks); these models check only the shape.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

MAX_PROMPTS = 1024  # prompts in one /v1/completions request
MAX_METADATA_PAIRS = 16
# OpenAI's bound on its identifier strings (user, safety_identifier, prompt_cache_key: "string
# too long. Expected a string with maximum length 64"). A stored response echoes them: bounded,
# a client cannot grow the store's entries through them.
MAX_IDENTIFIER_CHARS = 64
# vLLM refuses a priority other than 0 unless priority scheduling is on: here it never is
PRIORITY_REFUSAL = ("priority scheduling is not enabled on this server (requests run first "
                    "come, first served): priority must be 0")
Identifier = Annotated[str, StringConstraints(max_length=MAX_IDENTIFIER_CHARS)] | None


# ---- request bodies ------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk too


class _SamplingFields(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[str, float] | None = None
    user: Identifier = None
    cache_salt: str | None = None
    return_token_ids: bool = False
    prompt_logprobs: int | None = None  # vLLM's: per prompt token, its logprob and the top ones
    # OpenAI's: up to 16 string pairs about the request. No effect on generation; --trace-out
    # records two of them for the workload profile: session_id and workload (e.g. "rag").
    metadata: dict[str, str] | None = None
    # vLLM's: lower runs earlier under priority scheduling; this server schedules first come,
    # first served, so (as vLLM without --scheduling-policy priority) only 0 is served.
    priority: int = 0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs object and its
    # older guided_* fields (pagedjax.serving.structured turns them into one StructuredOutputs).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # OpenAI's Predicted Outputs: {"type": "content", "content": text or text parts}, the
    # output as the client expects it; with speculative decoding on, the request's drafts.
    prediction: dict[str, Any] | None = None

    def prediction_text(self) -> str | None:
        """The predicted content as one text (None without a prediction); ValueError when the
        prediction is not OpenAI's shape."""
        if self.prediction is None:
            return None
        content = self.prediction.get("content")
        if self.prediction.get("type") != "content" or set(self.prediction) != {"type",
                                                                                "content"}:
            raise ValueError('prediction must be {"type": "content", "content": ...}')
        if isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            return "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ValueError("prediction.content must be a string or a list of text parts")
        return content

    def unsupported(self) -> list[tuple[str, str]]:
        """(field, why) for fields with values this engine does not implement."""
        found = []
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            found.append(("guided_decoding_backend", "guided_decoding_backend must be 'auto' or "
                          "'guidance' (this server's structured outputs use llguidance)"))
        if self.metadata is not None and (
                len(self.metadata) > MAX_METADATA_PAIRS
                or any(len(k) > 64 or len(v) > 512 for k, v in self.metadata.items())):
            found.append(("metadata", f"metadata holds at most {MAX_METADATA_PAIRS} pairs, keys "
                          "of at most 64 characters and values of at most 512 (OpenAI's "
                          "limits)"))
        if self.prompt_logprobs is not None and self.stream:
            found.append(("prompt_logprobs", "prompt_logprobs are not available when stream is "
                          "true (as in vLLM)"))
        if self.priority != 0:
            found.append(("priority", PRIORITY_REFUSAL))
        try:
            self.prediction_text()
        except ValueError as error:
            found.append(("prediction", str(error)))
        if self.guided_whitespace_pattern is not None:
            found.append(("guided_whitespace_pattern", "guided_whitespace_pattern is not "
                          "supported (use structured_outputs.disable_any_whitespace)"))
        return found


class CompletionRequest(_SamplingFields):
    # A string, a list of strings, token ids, or a list of token-id lists: told apart by
    # split_prompts, token ids checked by the engine (a union of typed lists would validate a
    # long bad list once per branch).
    prompt: str | list = Field(...)
    max_tokens: int | None = 16
    best_of: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self):
        found = super().unsupported()
        if self.suffix:
            found.append(("suffix", "suffix is not supported"))
        if self.stream and self.best_of is not None and self.best_of > self.n:
            found.append(("best_of", "best_of > n cannot stream (the best n are known only at "
                          "the end)"))
        return found


class ChatMessage(BaseModel):
    # Beside role and content, what a role's message carries (name, tool_calls, tool_call_id,
    # ...) goes to the chat template as it is.
    model_config = ConfigDict(extra="allow")

    role: str = Field(..., min_length=1, max_length=64)
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message is left open (no end-of-turn) for the model to continue it.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: documents a RAG model's chat template renders (each a dict of strings, e.g. title
    # and text); refused when the template does not use them.
    documents: list[dict[str, str]] | None = None
    # Tool calling (pagedjax.serving.tool_calls); functions / function_call are OpenAI's
    # deprecated spelling of tools / tool_choice.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # Passed to the chat template (as vLLM does), for templates that read it.
    reasoning_effort: str | None = None
    # vLLM's: with a --reasoning-parser, false leaves the reasoning out of the reply.
    include_reasoning: bool = True
    # No effect on a self-hosted engine by nature (README's API section): there is no stored-
    # completions product, one service tier, and the prefix cache is automatic (content-keyed),
    # kept while its blocks are not needed ("in_memory"; "24h" is refused).
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: Identifier = None
    prompt_cache_key: Identifier = None
    prompt_cache_retention: str | None = None
    modalities: list[str] | None = None

    def unsupported(self):
        found = super().unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            found.append(("top_logprobs", "top_logprobs needs logprobs: true"))
        if self.continue_final_message and self.add_generation_prompt:
            found.append(("continue_final_message", "continue_final_message needs "
                          "add_generation_prompt: false (the final message is continued, not "
                          "answered)"))
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            found.append(("modalities", "this server generates text only: modalities must be "
                          "[\"text\"]"))
        if self.prompt_cache_retention not in (None, "in_memory"):
            found.append(("prompt_cache_retention", "the prefix cache lives in device memory "
                          "only: prompt_cache_retention must be \"in_memory\""))
        if self.service_tier not in (None, "auto", "default"):
            found.append(("service_tier", "this server has one service tier: service_tier "
                          "must be \"auto\" or \"default\""))
        if self.reasoning_effort is not None and self.reasoning_effort not in REASONING_EFFORTS:
            found.append(("reasoning_effort", f"reasoning_effort must be one of "
                          f"{', '.join(REASONING_EFFORTS)}"))
        return found


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize of a text (vLLM's TokenizeCompletionRequest)."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """POST /tokenize of a conversation through the chat template (vLLM's TokenizeChatRequest)."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None,
               prediction: tuple[int, int] | None = None) -> dict:
    """OpenAI's usage object; with cached_tokens (vLLM's --enable-prompt-tokens-details), the
    prompt tokens the prefix cache served, in prompt_tokens_details; with prediction (a
    request's Predicted Outputs: its drafts accepted and rejected), completion_tokens_details'
    accepted_prediction_tokens and rejected_prediction_tokens."""
    usage: dict[str, object] = {"prompt_tokens": prompt_tokens,
                                "completion_tokens": completion_tokens,
                                "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if prediction is not None:
        usage["completion_tokens_details"] = {"accepted_prediction_tokens": prediction[0],
                                              "rejected_prediction_tokens": prediction[1]}
    return usage


def wire_logprob(value: float) -> float:
    """A logprob as JSON carries it: a token a processed logprobs_mode filtered out (-inf) is
    -9999.0, as vLLM sends it (JSON has no infinity)."""
    return max(value, -9999.0)


def prompt_logprobs_json(entries, prompt_token_ids, num_top: int) -> list | None:
    """vLLM's prompt_logprobs on the wire: None for the first prompt token, then per token
    {token id: {"logprob", "rank", "decoded_token"}} of the token itself and the num_top most
    likely (the engine may hold more, when echo with logprobs asked for more)."""
    if entries is None:
        return None
    return [None if entry is None else {
        token_id: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token_id, lp in entry.items()
        if token_id == prompt_token_ids[position] or lp.rank is not None and lp.rank <= num_top}
        for position, entry in enumerate(entries)]


def split_prompts(prompt: str | list) -> list[str | list]:
    """A completion request's prompts: each a string or a token-id list; raises ValueError."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise ValueError("prompt must be non-empty (a string, token ids, or a list of them)")
    if all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise ValueError(f"prompt holds {len(prompt)} prompts, more than {MAX_PROMPTS}")
        if any(len(p) == 0 for p in prompt):
            raise ValueError("prompt must be non-empty (a string, token ids, or a list of "
                             "them)")
        return list(prompt)
    return [prompt]  # token ids
