"""Server-sent events: the framing, the guard that ends a stream whose engine failed, and the
one rule both endpoints stream by (what each choice has sent already, what is news)."""

from __future__ import annotations

import json

from pagedjax.engine.outputs import CompletionOutput
from pagedjax.frontend.async_engine import EngineDeadError, RequestFailedError
from pagedjax.serving.http_common import error_body

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def guard(events):
    """A stream whose engine dies mid-way ends with an error event, then [DONE]."""
    try:
        async for event in events:
            yield event
    except EngineDeadError as e:
        yield sse(error_body(str(e), "server_error", None, "engine_dead"))
        yield DONE
    except RequestFailedError as e:
        yield sse(error_body(str(e), "server_error", None, "request_failed"))
        yield DONE
    finally:
        await events.aclose()  # a client that went away: abort its requests now


class DeltaTracker:
    """What each streamed choice has sent so far: (characters, tokens) by key.

    per_token: the client asked for every token (logprobs, token ids, or there is no text), so a
    token that adds no visible text (a held-back byte of a character, a stop-string prefix) is
    still news; otherwise only new text is."""

    def __init__(self, per_token: bool):
        self.per_token = per_token
        self.sent: dict = {}

    def advance(self, key, choice: CompletionOutput) -> tuple[str, int, int] | None:
        """(new text, characters sent before it, tokens sent before it), or None when the
        choice brings nothing this client asked for; a finished choice always answers."""
        chars, tokens = self.sent.get(key, (0, 0))
        text = choice.text or ""
        if choice.finish_reason is None and (
                len(choice.token_ids) == tokens or len(text) == chars and not self.per_token):
            return None
        self.sent[key] = (len(text), len(choice.token_ids))
        return text[chars:], chars, tokens
