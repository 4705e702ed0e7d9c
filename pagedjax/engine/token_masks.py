"""Per-row token bitmasks: allowed_token_ids, bad_words, min_tokens and structured outputs by one
mechanism, built on the host while the device runs the step's forward.

Row b of a mask is W = ceil(V / 32) words; bit j of word w set means token 32 w + j may be
sampled (llguidance's layout, applied by pagedjax.engine.sampler.apply_token_mask). A step where
no sampled row is constrained sends no mask at all (the sampler's program then has no mask work).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Sequence

import numpy as np

from pagedjax.engine import grammar
from pagedjax.engine.grammar import GrammarState
from pagedjax.scheduler import Request, RequestError, SamplingParams

logger = logging.getLogger("pagedjax.token_masks")


@dataclasses.dataclass(frozen=True)
class Constraints:
    """What a request's SamplingParams restrict, checked and compiled at admission."""

    allowed: np.ndarray | None  # u32[W]: allowed_token_ids as mask words
    bad_words: tuple[tuple[int, ...], ...]  # token sequences; the last is banned after the rest
    min_tokens: int
    stop_ids: tuple[int, ...]  # banned until min_tokens outputs: EOS and stop_token_ids
    grammar: str | None  # llguidance grammar text
    grammar_kind: str | None = None
    # The grammar's matcher at its start, checked at admission; each sample gets a copy.
    start: GrammarState | None = dataclasses.field(default=None, compare=False)


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's tokenization of bad_words: each word as itself and, when that makes a different
    word token of the same length, with a leading space (a word at the start of the text and in
    the middle of it)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return tuple(dict.fromkeys(s for s in sequences if s))


def _clear(row: np.ndarray, token_id: int) -> None:
    row[token_id >> 5] &= ~np.uint32(1 << (token_id & 31))


class _SampleState:
    """One sample's constraints and, with a grammar, its matcher."""

    def __init__(self, constraints: Constraints, matcher: GrammarState | None):
        self.constraints = constraints
        self.matcher = matcher

    def fill(self, rows: np.ndarray, request: Request, drafts: Sequence[int] = ()) -> None:
        """ANDs what request may sample into rows[0] and, with speculative drafts, what it may
        sample after its first j drafts into rows[j] (j <= len(drafts)): the grammar's matcher
        walks the drafts and is rolled back after."""
        history = request.output_token_ids
        for j in range(len(drafts) + 1):
            if j:
                history = history + [drafts[j - 1]]
                if self.matcher is not None:
                    self.matcher.speculate(drafts[j - 1])
            self._fill_one(rows[j], history)
        if self.matcher is not None and drafts:
            self.matcher.rollback(len(drafts))

    def _fill_one(self, row: np.ndarray, out: Sequence[int]) -> None:
        c = self.constraints
        if c.allowed is not None:
            row &= c.allowed
        for sequence in c.bad_words:
            prefix = len(sequence) - 1
            if prefix == 0 or (len(out) >= prefix and tuple(out[-prefix:]) == sequence[:-1]):
                _clear(row, sequence[-1])
        if len(out) < c.min_tokens:
            for token_id in c.stop_ids:
                _clear(row, token_id)
        if self.matcher is not None:
            self.matcher.fill_mask(row)
            if not row.any():  # the grammar wants to end, min_tokens not yet: the grammar wins
                row[:] = 0xFFFFFFFF
                self.matcher.fill_mask(row)


class TokenMasks:
    """The engine's constraint states, one a sample, and the masks of its steps."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.words = grammar.mask_words(vocab_size)
        self._grammar_tokenizer = None  # built on the first grammar request
        self._states: dict[str, _SampleState] = {}

    def constraints(self, params: SamplingParams) -> Constraints | None:
        """A request's constraints, or None when it has none; RequestError naming the field
        when one cannot be met (ids outside the vocabulary, no tokenizer, a bad grammar)."""
        if (params.allowed_token_ids is None and not params.bad_words and not params.min_tokens
                and params.structured_outputs is None):
            return None
        allowed = None
        if params.allowed_token_ids is not None:
            ids = np.asarray(params.allowed_token_ids, np.int64)
            if ids.max() >= self.vocab_size:
                raise RequestError("allowed_token_ids", f"allowed_token_ids must hold token ids "
                                   f"in [0, vocab_size={self.vocab_size}), got {int(ids.max())}")
            allowed = np.zeros(self.words, np.uint32)
            np.bitwise_or.at(allowed, ids >> 5, (1 << (ids & 31)).astype(np.uint32))
        for field in ("bad_words", "structured_outputs"):
            if getattr(params, field) and self.tokenizer is None:
                raise RequestError(field, f"{field} needs a tokenizer; this engine has none")
        bad = bad_words_token_ids(self.tokenizer, params.bad_words) if params.bad_words else ()
        stop_ids = tuple(params.stop_token_ids) + (() if params.ignore_eos else
                                                    self.eos_token_ids)
        text, kind, start = None, None, None
        if params.structured_outputs is not None:
            kind = params.structured_outputs.kind
            text = grammar.grammar_text(params.structured_outputs)
            grammar.check_grammar(text, self.grammar_tokenizer(), kind)
            start = grammar.check_start(text, self.grammar_tokenizer(), kind, self.vocab_size)
        return Constraints(allowed, bad, params.min_tokens, stop_ids, text, kind, start)

    def grammar_tokenizer(self):
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = grammar.grammar_tokenizer(
                self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammar_tokenizer

    def add(self, samples: Sequence[Request], constraints: Constraints | None) -> None:
        """Starts the states of a request's samples (each its own matcher)."""
        if constraints is None:
            return
        start = constraints.start
        for sample in samples:  # each its own copy of the matcher checked at admission
            self._states[sample.request_id] = _SampleState(
                constraints, None if start is None else start.copy())

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def clear(self) -> None:
        self._states.clear()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def build(self, rows: Sequence[tuple[Request, bool, list[int]]], padded_seqs: int,
              num_speculative_tokens: int = 0) -> np.ndarray | None:
        """The step's mask for its rows, (request, whether it samples this step, its drafts) in
        plan order: i32[B, W], or with K = num_speculative_tokens draft columns
        i32[B * (K + 1), W] (row b's position j at b * (K + 1) + j, what it may sample after
        its first j drafts); None when no sampling row is constrained."""
        states = [(i, s, r, d) for i, (r, sampling, d) in enumerate(rows)
                  if sampling and (s := self._states.get(r.request_id)) is not None]
        if not states:
            return None
        width = num_speculative_tokens + 1
        mask = np.full((padded_seqs * width, self.words), 0xFFFFFFFF, np.uint32)
        for i, state, request, drafts in states:
            state.fill(mask[i * width:(i + 1) * width], request, drafts)
        return mask.view(np.int32)

    def needs_history(self, request: Request) -> bool:
        """Whether request's next mask depends on the tokens it has sampled (a grammar, or a
        bad word of several tokens), not only on how many (min_tokens) or on nothing."""
        state = self._states.get(request.request_id)
        return state is not None and (state.matcher is not None or any(
            len(sequence) > 1 for sequence in state.constraints.bad_words))

    def num_valid(self, request: Request, drafts: Sequence[int]) -> int:
        """How many of drafts (to follow request's tokens) its grammar accepts in a row (all
        of them without a grammar)."""
        state = self._states.get(request.request_id)
        if state is None or state.matcher is None:
            return len(drafts)
        return state.matcher.num_valid(drafts)

    def advance(self, sample: Request) -> bool:
        """Feeds a sample's new tokens to its grammar; True when the grammar is complete (the
        output is whole: the request ends there)."""
        state = self._states.get(sample.request_id)
        if state is None or state.matcher is None:
            return False
        state.matcher.advance(sample.output_token_ids)
        if state.matcher.error is not None and state.matcher.done:
            logger.warning("request %s: its structured output dead-ended (%s); it stops there",
                           sample.request_id, state.matcher.error)
        return state.matcher.done


def step_rows(output) -> list[tuple[Request, bool, list[int]]]:
    """A schedule's rows in plan order (scheduled, then fork followers), each with whether it
    samples a token this step (its chunk reaches the end of its tokens) and the speculative
    drafts it verifies."""
    rows = [(seq.request, seq.start + seq.num_new_tokens >= seq.request.num_tokens, seq.drafts)
            for seq in output.scheduled]
    return rows + [(follower, True, []) for _, follower in output.forks]
