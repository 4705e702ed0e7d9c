"""What a request's outputs say as text: each sample's incremental detokenization, cut at the
first stop string, with the tail that could still become one held back."""

from __future__ import annotations

from pagedjax.scheduler import Request
from pagedjax.text.detokenizer import IncrementalDetokenizer, StopStringMatcher


class TextState:
    """One sample's detokenized output: incremental, cut at the first stop string."""

    __slots__ = ("detokenizer", "matcher", "text", "num_tokens")

    def __init__(self, tokenizer, request: Request):
        params = request.sampling_params
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                  params.skip_special_tokens)
        self.matcher = (StopStringMatcher(params.stop, params.include_stop_str_in_output)
                        if params.stop else None)
        self.text = ""
        self.num_tokens = 0

    def advance(self, request: Request) -> bool:
        """Detokenizes request's new tokens; True when a stop string ended the text (then
        the request's stop_reason is that string)."""
        new = request.output_token_ids[self.num_tokens:]
        self.num_tokens += len(new)
        delta = self.detokenizer.push(new)
        if request.status.finished:
            delta += self.detokenizer.finish()
        self.text += delta
        if self.matcher is None or self.num_tokens <= request.sampling_params.min_tokens:
            return False  # as vLLM: no stop string before min_tokens
        cut = self.matcher.check(self.text, len(delta))
        if cut is None:
            return False
        self.text = self.text[:cut]
        if not request.status.finished:  # a stop token that came first keeps its reason
            request.stop_reason = self.matcher.matched
        return True

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: a tail that could still become a stop string is
        withheld until the request moves past it or finishes."""
        if finished or self.matcher is None:
            return self.text
        return self.text[:len(self.text) - self.matcher.holdback(self.text)]
