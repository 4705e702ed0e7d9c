"""The one admission path: every request (LLM, AsyncLLMEngine, beam search, the server) is checked
here against the engine's limits before anything is built, and queued all or none.

    specs = [PromptSpec(prompt_token_ids, SamplingParams(...)), ...]
    engine.add_requests(specs)          # RequestError (a ValueError) naming the field, or ids

A rejected call changes nothing: no Request objects, no samples, no blocks, no queue entries.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Sequence

import numpy as np

from pagedjax.scheduler import RequestError, SamplingParams, check_admission
from pagedjax.scheduler.errors import check_float

if TYPE_CHECKING:
    from pagedjax.pooling.params import PoolingParams

MAX_REQUEST_ID_CHARS = 256
MAX_CACHE_SALT_CHARS = 1024


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """One request to add: its prompt ids and sampling, optionally its id, the prompt's text (for
    the outputs) and a cache salt (requests share prefix-cached blocks only with equal salts)."""

    prompt_token_ids: Sequence[int]
    params: SamplingParams
    request_id: str | None = None
    prompt_text: str | None = None
    cache_salt: str | None = None
    arrival_time: float | None = None
    lora_request: object = None  # a pagedjax.LoRARequest: the adapter it runs under
    # a pooling request's (pagedjax.pooling.params.PoolingParams, its task set): the prompt
    # runs alone and returns pooled hidden states (params then is the engine's one-token form)
    pooling_params: PoolingParams | None = None
    # a BERT-like cross-encoder's segment of each prompt token (0 the query's, 1 the
    # document's): pooling requests of a model that reads them only
    token_type_ids: Sequence[int] | None = None


@dataclasses.dataclass(frozen=True)
class Admission:
    """A spec that passed every check: what the engine builds its samples from."""

    spec: PromptSpec
    prompt_token_ids: list[int]
    request_id: str | None  # None: the engine numbers it when it builds the request
    constraints: object = None  # token_masks.Constraints, or None
    lora: tuple[int, str] | None = None  # its adapter's (id, prefix-cache key)

    @property
    def num_tokens(self) -> int:
        """Tokens its samples may compute at most (prompt + max_tokens each): the admission
        budget's measure; a pooling request's: its prompt)."""
        params = self.spec.params
        if self.spec.pooling_params is not None:
            return len(self.prompt_token_ids)
        return params.num_samples * (len(self.prompt_token_ids) + params.max_tokens)


def check_prompt_token_ids(prompt_token_ids, vocab_size: int, max_len: int) -> list[int]:
    """The prompt as a list of ints in [0, vocab_size), at most max_len of them."""
    field = "prompt_token_ids"
    if isinstance(prompt_token_ids, (str, bytes, dict)) or not hasattr(prompt_token_ids,
                                                                      "__len__"):
        raise RequestError(field, f"{field} must be a list of token ids, got "
                           f"{type(prompt_token_ids).__name__}")
    if len(prompt_token_ids) == 0:
        raise RequestError(field, f"{field} must be a non-empty list of token ids")
    if len(prompt_token_ids) > max_len:  # before converting anything
        raise RequestError(field, f"{field} holds {len(prompt_token_ids)} tokens, more than "
                           f"max_model_len ({max_len})")
    if isinstance(prompt_token_ids, np.ndarray):
        ids = prompt_token_ids
    elif any(isinstance(t, bool) or not isinstance(t, (int, np.integer))
             for t in prompt_token_ids):
        raise RequestError(field, f"{field} must hold integers only")
    else:
        try:
            ids = np.asarray(prompt_token_ids, dtype=np.int64)
        except OverflowError:
            raise RequestError(field, f"{field} must be in [0, vocab_size={vocab_size})") from None
    if ids.ndim != 1:
        raise RequestError(field, f"{field} must be a flat list of token ids, got shape "
                           f"{ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise RequestError(field, f"{field} must be integers, got dtype {ids.dtype}")
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise RequestError(field, f"{field} must be in [0, vocab_size={vocab_size}), got "
                           f"{bad[:5].tolist()}")
    return ids.tolist()


def encode_text(tokenizer, text, field: str = "prompt", add_special_tokens: bool = True
                ) -> list[int]:
    """text's token ids; RequestError naming field when the text is not a string or not valid
    Unicode (a lone surrogate cannot be encoded as UTF-8)."""
    _check_readable(tokenizer, text, field)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _check_readable(tokenizer, text, field: str) -> None:
    """RequestError naming field unless text is valid Unicode text a tokenizer can read."""
    if not isinstance(text, str):
        raise RequestError(field, f"{field} must be a string, got {type(text).__name__}")
    if tokenizer is None:
        raise RequestError(field, f"{field} is text but the model has no tokenizer: send token "
                           "ids, or give the engine a tokenizer")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(field, f"{field} is not valid Unicode: {e.reason} at character "
                           f"{e.start}") from None


def encode_pair(tokenizer, first, second) -> tuple[list[int], list[int]]:
    """A cross-encoder's prompt of a (first, second) pair and each token's segment (0 the
    first's, 1 the second's), as vLLM builds it: two texts through the tokenizer's pair
    template (transformers' tokenizer(text, text_pair): BERT's [CLS] a [SEP] b [SEP],
    XLM-R's <s> a </s></s> b </s>, a Qwen tokenizer's plain concatenation); token ids (either
    side) as given, the first text with the tokenizer's special tokens, the second without.
    A tokenizer object of transformers' (LLM(tokenizer=...)) builds the pair itself."""
    pair = getattr(tokenizer, "encode_pair", None)
    if pair is None and hasattr(tokenizer, "model_input_names") and callable(tokenizer):
        pair = functools.partial(_transformers_pair, tokenizer)
    if isinstance(first, str) and isinstance(second, str) and pair is not None:
        _check_readable(tokenizer, first, "text_1")
        _check_readable(tokenizer, second, "text_2")
        return pair(first, second)
    a = encode_text(tokenizer, first, "text_1") if isinstance(first, str) else list(first)
    b = (encode_text(tokenizer, second, "text_2", False) if isinstance(second, str)
         else list(second))
    return a + b, [0] * len(a) + [1] * len(b)


def _transformers_pair(tokenizer, first: str, second: str) -> tuple[list[int], list[int]]:
    """encode_pair through a transformers tokenizer: tokenizer(first, second), its token types
    (segment 0 throughout where it keeps none)."""
    encoding = tokenizer(first, second, add_special_tokens=True, return_token_type_ids=True)
    ids = list(encoding["input_ids"])
    return ids, list(encoding.get("token_type_ids") or [0] * len(ids))


def _check_prediction(engine, prediction: Sequence[int]) -> None:
    """A prediction is the drafts' source: only an engine that speculates can use it."""
    if engine.config.speculative_config is None:
        raise RequestError("prediction", "prediction (Predicted Outputs) needs an engine with "
                           "speculative decoding: start it with --speculative-config "
                           "(e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4}')")
    if len(prediction) > engine.config.max_model_len:
        raise RequestError("prediction", f"prediction holds {len(prediction)} tokens, more than "
                           f"max_model_len ({engine.config.max_model_len})")


def _check_kind(engine, spec: PromptSpec) -> None:
    """A paged engine's runner serves its kind of request; token types are an encoder's."""
    if spec.token_type_ids is not None:
        raise RequestError("token_type_ids", "token_type_ids are read by a BERT-like encoder's "
                           "pooling requests only")
    if spec.pooling_params is None and engine.runner_type == "pooling":
        raise RequestError(None, "this engine runs runner='pooling' (no vocabulary "
                           "projection): it serves pooling requests only")


def check_spec(engine, spec: PromptSpec) -> Admission:
    """Every limit the engine puts on one request; raises RequestError naming the field."""
    if not isinstance(spec, PromptSpec):
        raise RequestError(None, f"a request must be a PromptSpec, got {type(spec).__name__}")
    params = spec.params
    if not isinstance(params, SamplingParams):
        raise RequestError("sampling_params", f"sampling_params must be a SamplingParams, got "
                           f"{type(params).__name__}")
    config, model_config = engine.config, engine.model_config
    _check_kind(engine, spec)
    vocab = model_config.vocab_size
    if params.num_samples > config.max_num_seqs:
        field = "best_of" if params.best_of is not None else "n"
        raise RequestError(field, f"{field} ({params.num_samples}) exceeds max_num_seqs "
                           f"({config.max_num_seqs})")
    if params.max_tokens > config.max_model_len:
        raise RequestError("max_tokens", f"max_tokens ({params.max_tokens}) exceeds "
                           f"max_model_len ({config.max_model_len})")
    if params.top_k > vocab:
        raise RequestError("top_k", f"top_k ({params.top_k}) exceeds the vocabulary "
                           f"({vocab}); -1 disables it")
    for field in ("logprobs", "prompt_logprobs"):
        if (getattr(params, field) or 0) > config.max_logprobs:
            raise RequestError(field, f"{field} ({getattr(params, field)}) exceeds "
                               f"max_logprobs ({config.max_logprobs})")
    if params.stop and engine.tokenizer is None:
        raise RequestError("stop", "stop strings need a tokenizer; this engine has none (pass "
                           "stop_token_ids, or give the engine a tokenizer)")
    if params.prediction is not None:
        _check_prediction(engine, params.prediction)
    for field, ids in (("stop_token_ids", params.stop_token_ids),
                       ("logit_bias", [token_id for token_id, _ in params.logit_bias]),
                       ("prediction", params.prediction or ())):
        for token_id in ids:
            if token_id >= vocab:
                raise RequestError(field, f"{field} must hold token ids in [0, vocab_size="
                                   f"{vocab}), got {token_id}")
    _check_text("request_id", spec.request_id, MAX_REQUEST_ID_CHARS)
    _check_text("cache_salt", spec.cache_salt, MAX_CACHE_SALT_CHARS)
    if spec.arrival_time is not None:
        check_float("arrival_time", spec.arrival_time, -float(2**62), float(2**62))
    if spec.prompt_text is not None and not isinstance(spec.prompt_text, str):
        raise RequestError("prompt", f"prompt must be a string, got "
                           f"{type(spec.prompt_text).__name__}")
    ids = check_prompt_token_ids(spec.prompt_token_ids, vocab, config.max_model_len)
    sample_ids = []
    if spec.request_id is not None:
        if spec.request_id in engine.request_groups:
            raise RequestError("request_id", f"request_id {spec.request_id!r} is already in use")
        sample_ids = ([spec.request_id] if params.num_samples == 1 else
                      [f"{spec.request_id}#{i}" for i in range(params.num_samples)])
    for state in engine.scheduler_states():  # a data-parallel engine: every replica's ids
        check_admission(state, params.num_samples, len(ids), params.max_tokens, sample_ids)
    lora = None if spec.lora_request is None else check_lora(engine, spec.lora_request)
    if spec.pooling_params is not None:
        engine.check_pooling_params(spec.pooling_params)
    return Admission(spec, ids, spec.request_id, engine.token_masks.constraints(params), lora)


def check_lora(engine, lora_request) -> tuple[int, str]:
    """The adapter's (id, prefix-cache key), read and checked (pagedjax.lora.manager)."""
    manager = engine.lora_manager
    if manager is None:
        raise RequestError("lora_request", "this engine serves no LoRA adapters; build it with "
                           "enable_lora=True")
    try:
        return manager.check(lora_request)
    except ValueError as error:
        raise RequestError("lora_request", str(error)) from None


def check_specs(engine, specs: Sequence[PromptSpec]) -> list[Admission]:
    """check_spec for each, with unique ids across them; a batch's error names its index."""
    if isinstance(specs, (str, bytes)) or not isinstance(specs, (list, tuple)) or not specs:
        raise RequestError("prompts", "prompts must be a non-empty list of requests")
    admissions = []
    for i, spec in enumerate(specs):
        try:
            admissions.append(check_spec(engine, spec))
        except RequestError as e:
            if len(specs) == 1:
                raise
            raise RequestError(e.field, f"request {i}: {e}") from None
    ids = [a.request_id for a in admissions if a.request_id is not None]
    if len(set(ids)) != len(ids):
        raise RequestError("request_id", "request ids must be unique")
    return admissions


def _check_text(field: str, value, max_chars: int) -> None:
    if value is None:
        return
    if not isinstance(value, str):
        raise RequestError(field, f"{field} must be a string, got {type(value).__name__}")
    if len(value) > max_chars:
        raise RequestError(field, f"{field} must be at most {max_chars} characters, got "
                           f"{len(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(field, f"{field} is not valid Unicode: {e.reason} at character "
                           f"{e.start}") from None
