"""The n-gram (prompt lookup) proposer of speculative decoding, on the host in NumPy: the
longest suffix of a request's tokens (prompt and output) that occurred earlier in them, between
prompt_lookup_min and prompt_lookup_max tokens long, and the k tokens that followed its most
recent earlier occurrence are the drafts (vLLM's `method: "ngram"`; vLLM matches with KMP in
numba, here each n is one vectorised comparison of every window against the suffix). When that
continuation runs into the end of the tokens, it goes on with the tokens it predicts: the text
since the occurrence repeated, as a periodic run would continue (vLLM stops at the end, so a
repetition proposes one token a step).

A proposal costs O(L x n) comparisons a request for L tokens, on the host before each step is
scheduled (pagedjax.engine.spec_decode.speculator)."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class NgramProposer:
    num_speculative_tokens: int  # k: the most drafts a proposal holds
    prompt_lookup_min: int = 1  # the shortest suffix that may match
    prompt_lookup_max: int = 4  # the longest suffix tried (first: the longest match wins)

    def __post_init__(self):
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")

    def propose(self, token_ids, max_drafts: int | None = None) -> np.ndarray:
        """i32[<= k] drafts to follow token_ids (empty when no suffix of the allowed lengths
        occurred before). max_drafts caps k (what the request may still generate)."""
        tokens = np.asarray(token_ids, np.int64)
        k = self.num_speculative_tokens if max_drafts is None else min(
            self.num_speculative_tokens, max_drafts)
        length = tokens.shape[0]
        if k <= 0:
            return np.zeros(0, np.int32)
        for n in range(min(self.prompt_lookup_max, length - 1), self.prompt_lookup_min - 1,
                       -1):
            # windows starting at 0 .. length - n - 1: every earlier occurrence, each followed
            # by at least one token (the suffix itself, at length - n, is left out)
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence's continuation
                # a continuation that reaches the end goes on with what it predicts: the
                # tokens from start on, repeated (a run of period length - start)
                return np.resize(tokens[start:], k).astype(np.int32)
        return np.zeros(0, np.int32)

    def propose_in(self, source, tokens, max_drafts: int | None = None) -> np.ndarray:
        """i32[<= k] drafts from source, a prediction of what tokens (the output so far) will
        be (OpenAI's Predicted Outputs): with no tokens yet, source's first k; else the longest
        suffix of tokens, prompt_lookup_max tokens down to one, found in source, and the k
        tokens after its occurrence nearest to where tokens end (an output follows its
        prediction with local edits); empty when no suffix occurs."""
        source = np.asarray(source, np.int64)
        k = self.num_speculative_tokens if max_drafts is None else min(
            self.num_speculative_tokens, max_drafts)
        length = len(tokens)
        if k <= 0:
            return np.zeros(0, np.int32)
        if not length:
            return source[:k].astype(np.int32)
        tail = np.asarray(tokens[-self.prompt_lookup_max:], np.int64)
        for n in range(min(len(tail), len(source) - 1), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(source[:-1], n)
            hits = np.flatnonzero((windows == tail[len(tail) - n:]).all(axis=1))
            if hits.size:
                start = int(hits[np.argmin(np.abs(hits + n - length))]) + n
                return source[start:start + k].astype(np.int32)
        return np.zeros(0, np.int32)
