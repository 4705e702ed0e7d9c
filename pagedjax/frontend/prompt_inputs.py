"""The prompts LLM's methods take, vLLM's forms: a string (needs a tokenizer), a list of token ids,
{"prompt": str} (TextPrompt) or {"prompt_token_ids": [...]} (TokensPrompt, with an optional
"prompt", its text)."""

from __future__ import annotations

from pagedjax.engine.request_checks import encode_text
from pagedjax.scheduler import RequestError


def prompt_input(tokenizer, prompt) -> tuple[list[int], str | None]:
    """A prompt of LLM's (a string, token ids, vLLM's TextPrompt or TokensPrompt dict) as (token
    ids, its text or None); a string needs the tokenizer."""
    if isinstance(prompt, str):
        return encode_text(tokenizer, prompt), prompt
    if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
        keys = set(prompt)
        if keys == {"prompt"}:
            if not isinstance(prompt["prompt"], str):
                raise RequestError("prompt", f"prompt must be a string, got "
                                   f"{type(prompt['prompt']).__name__}")
            return encode_text(tokenizer, prompt["prompt"]), prompt["prompt"]
        if keys in ({"prompt_token_ids"}, {"prompt_token_ids", "prompt"}):
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise RequestError("prompt", f"prompt must be a string, got "
                                   f"{type(text).__name__}")
            return prompt["prompt_token_ids"], text
        raise RequestError("prompt", f"a prompt dict holds prompt (text) or "
                           f"prompt_token_ids (and optionally its prompt text), got "
                           f"{sorted(map(str, prompt))[:8]}")
    return prompt, None  # token ids: check_specs checks them
