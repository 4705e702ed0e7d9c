"""Speculative decoding's configuration: vLLM's `speculative_config` (a SpeculativeConfig, a
dict of its fields or their JSON), checked field by field; vLLM's fields this engine does not
serve are refused by name."""

from __future__ import annotations

import dataclasses
import json

from pagedjax.engine.spec_decode.ngram_proposer import NgramProposer

METHODS = ("ngram", "draft_model")
# vLLM's SpeculativeConfig fields this engine does not serve (yet): refused by name.
UNSUPPORTED = ("draft_tensor_parallel_size", "quantization", "max_model_len",
               "revision", "code_revision", "speculative_token_tree",
               "disable_padded_drafter_batch", "suffix_decoding_max_tree_depth",
               "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
               "suffix_decoding_min_token_prob", "hf_overrides", "enforce_eager")
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min / _max when neither is given


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's names. num_speculative_tokens: the most drafts a step verifies for a request (K).
    prompt_lookup_min / _max: the n-gram lengths tried (vLLM's rule: neither given, both 5; one
    given, the other equals it). disable_by_batch_size: a step with more running sequences than
    this speculates for none of them (at high load verifying drafts costs more than it saves);
    None: always."""

    method: str | None = None  # vLLM's default: draft_model when a model is given, else ngram
    num_speculative_tokens: int = None  # type: ignore[assignment]  # required: None is refused
    model: str | None = None  # draft_model: the draft (a path or config name, as LLM's model)
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        if self.method is None:
            object.__setattr__(self, "method", "ngram" if self.model is None else "draft_model")
        if self.method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {METHODS}, got "
                             f"{self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer "
                             f">= 1, got {k!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model of method "
                             "draft_model (and only of it)")
        if self.model is not None and not isinstance(self.model, str):
            raise ValueError(f"speculative_config.model must be a path or config name, got "
                             f"{type(self.model).__name__}")
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if low is None and high is None:
            low = high = DEFAULT_LOOKUP
        low, high = (high if low is None else low), (low if high is None else high)
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        try:
            self.proposer()
        except ValueError as error:
            raise ValueError(f"speculative_config: {error}") from None
        limit = self.disable_by_batch_size
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                                  or limit < 1):
            raise ValueError(f"speculative_config.disable_by_batch_size must be an integer "
                             f">= 1, got {limit!r}")

    @classmethod
    def create(cls, value) -> "SpeculativeConfig | None":
        """From a SpeculativeConfig, a dict of vLLM's fields or its JSON text (the
        --speculative-config flag); None stays None. Unknown and unserved fields are refused
        by name."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict of vLLM's fields, got "
                             f"{type(value).__name__}")
        served = {f.name for f in dataclasses.fields(cls)}
        unserved = sorted(k for k in value if k in UNSUPPORTED)
        if unserved:
            raise ValueError(f"speculative_config field(s) {unserved} are not served by this "
                             f"engine (its methods: {METHODS})")
        unknown = sorted(set(value) - served)
        if unknown:
            raise ValueError(f"unknown speculative_config field(s) {unknown}; known: "
                             f"{sorted(served)}")
        return cls(**value)

    def proposer(self) -> NgramProposer:
        k, low, high = (self.num_speculative_tokens, self.prompt_lookup_min,
                        self.prompt_lookup_max)
        assert k is not None and low is not None and high is not None, "set by __post_init__"
        return NgramProposer(k, low, high)
