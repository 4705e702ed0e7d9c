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
    """What each streamed choice has sent so far, by key: its characters, tokens and text. The
    choices are DELTA ones (SamplingParams.output_kind: the server's requests ask for them),
    each holding only what is new.

    per_token: the client asked for every token (logprobs, token ids, or there is no text), so a
    token that adds no visible text (a held-back byte of a character, a stop-string prefix) is
    still news; otherwise only new text is."""

    def __init__(self, per_token: bool):
        self.per_token = per_token
        # key -> [characters, tokens, the text's pieces, whether a chunk was sent]
        self.sent: dict = {}

    def advance(self, key, choice: CompletionOutput) -> tuple[str, int, bool] | None:
        """(new text, characters sent before it, whether it is the choice's first chunk), or
        None when the choice brings nothing this client asked for; a finished choice always
        answers."""
        sent = self.sent.setdefault(key, [0, 0, [], False])
        chars, first = sent[0], not sent[3]
        text = choice.text or ""
        if text:
            sent[0] += len(text)
            sent[2].append(text)
        sent[1] = choice.num_tokens
        if choice.finish_reason is None and not text and not (
                self.per_token and choice.token_ids):
            return None
        sent[3] = True
        return text, chars, first

    def text(self, key) -> str:
        """The choice's text so far (joined when asked: the plain stream never asks)."""
        if key not in self.sent:
            return ""
        pieces = self.sent[key][2]
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    def tokens(self, key) -> int:
        """The choice's tokens so far."""
        return self.sent[key][1] if key in self.sent else 0
