"""What the router routes a request by, read from its body without tokenizing: its prefix (the
completion prompt, or the conversation rendered role by role) and that prefix's length in
tokens (text estimated at CHARS_PER_TOKEN characters a token)."""

from __future__ import annotations

CHARS_PER_TOKEN = 4  # a text prompt's tokens, estimated (the chunk rule's 64 characters ~ 16)


def prompt_tokens(key: str | list[int]) -> int:
    """A routing key's length in tokens: token ids counted, text estimated at CHARS_PER_TOKEN
    characters a token (the router does not tokenize)."""
    return len(key) if isinstance(key, list) else len(key) // CHARS_PER_TOKEN


def routing_key(path: str, body: dict) -> str | list[int] | None:
    """What a request's prefix is: the completion prompt (the first, for a batch), or the
    conversation rendered role by role (a conversation's earlier turns are a prefix of it)."""
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                return None
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p["text"] for p in content
                                  if isinstance(p, dict) and isinstance(p.get("text"), str))
            if not isinstance(content, str):
                content = ""
            role = m.get("role") if isinstance(m.get("role"), str) else ""
            parts.append(f"<|{role}|>{content}")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str) or (isinstance(prompt, list)
                                   and all(isinstance(t, int) for t in prompt)):
        return prompt
    return None


def request_model(body) -> str | None:
    """The model (or LoRA adapter) a request names, if any: its prefixes' KV is that model's."""
    model = body.get("model") if isinstance(body, dict) else None
    return model if isinstance(model, str) else None
