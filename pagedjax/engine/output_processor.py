"""What a request's outputs say as text: each sample's incremental detokenization, cut at the
first stop string, with the tail that could still become one held back."""

from __future__ import annotations

from pagedjax.scheduler import Request
from pagedjax.text.detokenizer import IncrementalDetokenizer, StopStringMatcher


class TextState:
    """One sample's detokenized output: incremental, cut at the first stop string.

    The text is kept as the pieces each token added (joined when read whole), and stop strings
    are searched in its tail: a token costs O(its text + the longest stop string), not O(the
    text so far)."""

    __slots__ = ("detokenizer", "matcher", "pieces", "length", "num_tokens", "longest_stop")

    def __init__(self, tokenizer, request: Request):
        params = request.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                  params.skip_special_tokens)
        self.matcher = (StopStringMatcher(params.stop, params.include_stop_str_in_output)
                        if params.stop else None)
        self.longest_stop = max((len(s) for s in params.stop), default=0)
        self.pieces: list[str] = []
        self.length = 0  # characters of text
        self.num_tokens = 0

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def tail(self, num_chars: int) -> str:
        """The text's last num_chars characters (fewer when it is shorter)."""
        parts, have = [], 0
        for piece in reversed(self.pieces):
            if have >= num_chars:
                break
            parts.append(piece)
            have += len(piece)
        joined = "".join(reversed(parts))
        return joined[len(joined) - min(num_chars, len(joined)):]

    def advance(self, request: Request) -> bool:
        """Detokenizes request's new tokens; True when a stop string ended the text (then
        the request's stop_reason is that string)."""
        new = request.output_token_ids[self.num_tokens:]
        self.num_tokens += len(new)
        delta = self.detokenizer.push(new)
        if request.status.finished:
            delta += self.detokenizer.finish()
        if delta:
            self.pieces.append(delta)
            self.length += len(delta)
        if self.matcher is None or self.num_tokens <= request.sampling_params.min_tokens:
            return False  # as vLLM: no stop string before min_tokens
        tail = self.tail(len(delta) + self.longest_stop - 1)  # where a match could newly end
        cut = self.matcher.check(tail, len(delta))
        if cut is None:
            return False
        keep = self.length - len(tail) + cut
        self.pieces[:] = [self.text[:keep]]
        self.length = keep
        if not request.status.finished:  # a stop token that came first keeps its reason
            request.stop_reason = self.matcher.matched
        return True

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: a tail that could still become a stop string is
        withheld until the request moves past it or finishes."""
        return self.text[:self.visible_length(finished)]

    def visible_length(self, finished: bool) -> int:
        """How many characters of the text a client may see now (visible_text's)."""
        if finished or self.matcher is None:
            return self.length
        return self.length - self.matcher.holdback(self.tail(self.longest_stop - 1))

    def slice(self, start: int, end: int) -> str:
        """text[start:end], reading only the pieces after start."""
        return self.tail(self.length - start)[:end - start]
