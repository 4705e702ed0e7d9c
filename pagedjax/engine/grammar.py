"""Structured outputs through llguidance: a request's StructuredOutputs as a grammar, its
matcher, and the token bitmask the matcher allows next.

llguidance (Microsoft's, one of vLLM's structured-output backends) is used rather than xgrammar
(vLLM's default) because it installs on its own: xgrammar's wheel requires torch, triton and
transformers at runtime, which the engine does not otherwise need (torch is only a test
reference here), on the CPU machines and in the GPU image alike. llguidance is a Rust
extension with no Python dependencies, and its masks are the bitmask layout the sampler
applies (32 tokens a word, little-endian bits).
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from pagedjax.scheduler import RequestError, StructuredOutputs

FIELD = "structured_outputs"


def mask_words(vocab_size: int) -> int:
    """Words of a row's token bitmask."""
    return (vocab_size + 31) // 32


class _TokenTable:
    """The llguidance.TokenizerWrapper protocol over a tokenizer that lists its tokens' bytes
    (pagedjax.text.tokenizer.ByteTokenizer)."""

    def __init__(self, tokenizer):
        self.tokens = tokenizer.token_bytes()
        self.eos_token_id = tokenizer.eos_token_ids[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = [i for i in range(len(self.tokens)) if i >= 256]
        self._tokenizer = tokenizer

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def grammar_tokenizer(tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
    """llguidance's tokenizer for the engine's (its token table: built once, about a second for
    a 100k vocabulary). vocab_size is the model's (the logits' width)."""
    import llguidance
    eos = list(eos_token_ids) or None
    if hasattr(tokenizer, "to_json"):  # a Hugging Face tokenizers.Tokenizer (also GGUF's)
        return llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "token_bytes"):
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTable(tokenizer)),
                                      n_vocab=vocab_size, eos_token=eos)
    raise RequestError(FIELD, f"structured outputs need a Hugging Face tokenizer; this engine's "
                       f"{type(tokenizer).__name__} has no token table")


def grammar_text(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a request's StructuredOutputs."""
    from llguidance import LLMatcher, grammar_from
    kind = spec.kind
    if kind in ("json", "json_object"):
        defaults: Any = {"whitespace_flexible": not spec.disable_any_whitespace}
        try:
            return LLMatcher.grammar_from_json_schema(spec.schema_text, defaults=defaults)
        except (ValueError, TypeError) as error:
            raise RequestError(f"{FIELD}.json", f"{FIELD}.json is not a JSON schema llguidance "
                               f"accepts: {error}") from None
    if kind == "choice":
        return LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec.choice or ()))
    try:
        return grammar_from("regex" if kind == "regex" else "grammar", getattr(spec, kind))
    except ValueError as error:
        raise RequestError(f"{FIELD}.{kind}", f"{FIELD}.{kind}: {error}") from None


def check_grammar(grammar: str, tokenizer, kind: str) -> None:
    """RequestError naming the field when llguidance cannot compile the grammar."""
    from llguidance import LLMatcher
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:  # the reason without the grammar's text (errors never echo a client's input)
        reasons = [line.strip() for line in error.splitlines()
                   if line.strip().startswith("error:")]
        reason = f" ({reasons[0][:200]})" if reasons else ""
        raise RequestError(f"{FIELD}.{kind}", f"{FIELD}.{kind} does not compile{reason}")


def _reason(error: str) -> str:
    """llguidance's error, its first line only (the rest is the parser's internal state)."""
    first = (error or "").strip().splitlines()[0] if (error or "").strip() else "unknown"
    return {"NoExtensionBias": "no token of this model's vocabulary can start a match"}.get(
        first, first)[:160]


def check_start(grammar: str, tokenizer, kind: str, vocab_size: int) -> "GrammarState":
    """The grammar's matcher at its start (what the request's samples copy), or RequestError
    naming the field when the grammar can produce nothing at all with this vocabulary (a regex
    that matches nothing, a choice of characters no token spells)."""
    state = GrammarState(tokenizer, grammar, vocab_size)
    state.fill_mask(np.full(mask_words(vocab_size), 0xFFFFFFFF, np.uint32))
    if state._matcher.is_error():
        raise RequestError(f"{FIELD}.{kind}", f"{FIELD}.{kind} can never produce an output: "
                           f"{_reason(state._matcher.get_error())}")
    return state


class GrammarState:
    """One sample's matcher: the mask of what it may emit next, and the tokens it emitted.

    A grammar that dead-ends during generation (llguidance's limits: a lexer or parser item
    budget exhausted, say) lets only EOS through and sets `error` (a short reason): the sample
    ends there, its text what the grammar allowed so far."""

    def __init__(self, tokenizer, grammar: str, vocab_size: int):
        from llguidance import LLMatcher
        self._matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self._words = mask_words(tokenizer.vocab_size)
        self._vocab_words = mask_words(vocab_size)
        self._buffer = np.zeros((1, self._words), np.int32)
        self.num_consumed = 0
        self.error: str | None = None

    def fill_mask(self, out: np.ndarray) -> None:
        """ANDs the tokens the grammar allows next into out (i32[W] of the model's vocab; the
        ids past the tokenizer's vocabulary are never allowed)."""
        from llguidance.numpy import fill_next_token_bitmask
        fill_next_token_bitmask(self._matcher, self._buffer)
        n = min(self._words, self._vocab_words)
        out[:n] &= self._buffer[0, :n].view(np.uint32)
        out[n:] = 0

    def advance(self, tokens: Sequence[int]) -> None:
        """Consumes the tokens emitted since the last call; a grammar in error (it refused a
        token: only EOS after a dead end, which the mask allowed) sets `error`."""
        new = list(tokens[self.num_consumed:])
        if new and self.error is None and (not self._matcher.consume_tokens(new)
                                           or self._matcher.is_error()):
            self.error = _reason(self._matcher.get_error())
        self.num_consumed = len(tokens)

    def num_valid(self, tokens: Sequence[int]) -> int:
        """How many of tokens, in a row from the current state, the grammar accepts."""
        if self.error is not None or not tokens:
            return 0
        return self._matcher.validate_tokens(list(tokens))

    def speculate(self, token: int) -> None:
        """Consumes a speculative draft (num_valid accepted it); rollback undoes it."""
        self._matcher.consume_token(token)

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def done(self) -> bool:
        """The output is complete (the grammar allows nothing more but EOS), or dead-ended."""
        return self.error is not None or self._matcher.is_stopped()

    def copy(self) -> "GrammarState":
        other = object.__new__(GrammarState)
        other.__dict__.update(self.__dict__)
        other._matcher = self._matcher.deep_copy()
        other._buffer = self._buffer.copy()
        return other
