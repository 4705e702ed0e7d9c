"""Streaming detokenization (text that grows with each token, multi-byte characters held back
until whole) and stop strings (found across token boundaries, the text that could still
become one held back)."""

from __future__ import annotations

from typing import Sequence

NUM_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded before the first output token (as vLLM)


class IncrementalDetokenizer:
    """Streams the text of output tokens (vLLM's algorithm).

    Each step decodes a window of the sequence's ids and emits what the newest tokens add:

        ids:     ... | prefix_offset ......... | read_offset ....... | new tokens
        emitted:     |<- prefix_text (done) ->|<-------- delta -------------->|

    decoding the window with its left context gives neighbour-dependent tokens (SentencePiece
    "▁", byte-level pieces) the right spaces. Text ending in U+FFFD is an incomplete UTF-8
    character: it is held (offsets stay) until more tokens complete it, or until finish().
    Only the window is kept, so a step costs O(window), not O(sequence).

    The deltas joined (with finish()) equal tokenizer.decode(output ids) when the prompt is empty,
    for decoders that are local in this sense; a ByteFallback run of invalid bytes is not (it turns
    into one U+FFFD per byte only once the run is known to be invalid).
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)  # in the window, which starts at the prefix offset
        self._prefix_text = self._decode(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _step(self, flush: bool) -> str:
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix_text) or (text.endswith("\ufffd") and not flush):
            return ""
        delta = text[len(self._prefix_text):]
        self._ids = self._ids[self._read_offset:]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    def push(self, token_ids: Sequence[int]) -> str:
        """The text that `token_ids` (the newest output tokens) add to the output."""
        deltas = []
        for token_id in token_ids:
            self._ids.append(token_id)
            deltas.append(self._step(flush=False))
        return "".join(deltas)

    def finish(self) -> str:
        """Whatever is still held back (an incomplete character, as U+FFFD)."""
        return self._step(flush=True)


class StopStringMatcher:
    """Finds stop strings in a growing output text.

    check() searches only where a match could newly end, so calling it after every delta costs
    O(delta + longest stop string); holdback() says how much of the text's tail a stream must
    withhold because it could still become a stop string.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False):
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {stop!r}")
        self.stop = tuple(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self.matched: str | None = None  # the stop string check() last found

    def check(self, text: str, new_len: int) -> int | None:
        """The length to truncate `text` to when a stop string ends in its last `new_len` chars,
        else None. Of several matches the one that ends first wins (the longest on a tie), so the
        result does not depend on how the text was split into deltas."""
        if not 0 <= new_len <= len(text):
            raise ValueError(f"new_len must be in [0, len(text)={len(text)}], got {new_len}")
        old_len = len(text) - new_len
        matches = [(start + len(s), start, s) for s in self.stop  # must end past old_len
                   if (start := text.find(s, max(old_len - len(s) + 1, 0))) >= 0]
        if not matches:
            return None
        end, start, self.matched = min(matches)
        return end if self.include_stop_str_in_output else start

    def holdback(self, text: str) -> int:
        """How many trailing chars of `text` are a proper prefix of some stop string."""
        return max((k for s in self.stop for k in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:k])), default=0)
