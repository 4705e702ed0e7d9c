"""Requests and their sampling parameters: plain Python, validated on construction."""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from pagedjax.scheduler.errors import RequestError, check_bool, check_float, check_int
from pagedjax.scheduler.field_values import INT32_MAX, bias_pairs, int_tuple, str_tuple
from pagedjax.scheduler.output_kind import RequestOutputKind, output_kind
from pagedjax.scheduler.structured_outputs import StructuredOutputs

MAX_TEMPERATURE = 1e4
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 64  # biased tokens a request may name: the BatchPlan's slots a row
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range for a bias
MAX_ABS_PENALTY = 2.0  # OpenAI's range for presence_penalty and frequency_penalty
MAX_REPETITION_PENALTY = 100.0
MAX_BAD_WORDS = 256


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy. top_k == -1 disables top-k; top_p == 1 disables top-p;
    min_p == 0 disables min-p (vLLM's: a token whose probability, after temperature, is below
    min_p times the most likely token's is never sampled).
    seed makes a request's samples reproducible whatever else is in the batch; with no seed the
    engine draws one from its own seeded generator. n samples share the prompt's KV blocks;
    best_of >= n samples are drawn and the n with the highest cumulative logprob returned.
    Sample i uses seed + i, so it equals the same request run alone with that seed. Seeds
    take 64 bits; the sampler's key is made from their 32-bit fold (see fold_seed).
    """

    max_tokens: int = 16
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many most likely tokens (and the chosen one)
    # vLLM's prompt_logprobs: for each prompt token after the first, its logprob given the
    # tokens before it and this many most likely tokens there (the prompt is computed whole:
    # such a request reads nothing from the prefix cache, as in vLLM).
    prompt_logprobs: int | None = None
    # Text-level stops (need the engine's tokenizer): the output ends at the first occurrence,
    # which is cut from the text unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the detokenized text
    # OpenAI's logit_bias: {token id: bias in [-100, 100]} added to the logits before sampling
    # (greedy too); kept as sorted (id, bias) pairs. Logprobs stay the model's.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM's penalties: presence and frequency over the output tokens (subtracted once for a
    # token that occurred, and once per occurrence); repetition over prompt and output tokens
    # (a seen token's logit divided by it when positive, multiplied when not: transformers').
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0  # EOS and stop_token_ids (and stop strings) wait this many tokens
    allowed_token_ids: tuple[int, ...] | None = None  # sample only among these
    bad_words: tuple[str, ...] = ()  # never emitted (as vLLM: with and without a leading space)
    structured_outputs: StructuredOutputs | None = None  # a grammar the output must match
    # OpenAI's Predicted Outputs, tokenized: the output as the client expects it (mostly), the
    # source of this request's speculative drafts (an engine with speculative_config).
    prediction: tuple[int, ...] | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE  # vLLM's (output_kind.py)

    def __post_init__(self):
        object.__setattr__(self, "output_kind", output_kind(self.output_kind))
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", int_tuple("allowed_token_ids",
                                                                     self.allowed_token_ids))
        object.__setattr__(self, "bad_words", str_tuple("bad_words", self.bad_words))
        if self.prediction is not None:
            object.__setattr__(self, "prediction", int_tuple("prediction", self.prediction))
        if isinstance(self.structured_outputs, dict):
            object.__setattr__(self, "structured_outputs",
                               StructuredOutputs(**self.structured_outputs))
        object.__setattr__(self, "stop_token_ids", int_tuple("stop_token_ids",
                                                              self.stop_token_ids))
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif not isinstance(stop, (list, tuple)):
            raise RequestError("stop", f"stop must be a string or a list of strings, got "
                               f"{type(stop).__name__}")
        object.__setattr__(self, "stop", tuple(stop))
        self.validate()

    def validate(self) -> None:
        """Checks what needs no engine (types, ranges); the engine checks its own limits
        (n and best_of against max_num_seqs, top_k against the vocabulary, ...)."""
        check_int("n", self.n, 1, INT32_MAX)
        if self.best_of is not None:
            check_int("best_of", self.best_of, 1, INT32_MAX)
            if self.best_of < self.n:
                raise RequestError("best_of", f"best_of must be >= n ({self.n}), "
                                   f"got {self.best_of}")
        check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
        check_int("top_k", self.top_k, 1, INT32_MAX, allow=(-1,))
        check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        check_float("min_p", self.min_p, 0.0, 1.0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0, INT32_MAX)
        if self.seed is not None:
            check_int("seed", self.seed, 0, 2**64 - 1)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check_bool(name, getattr(self, name))
        if len(self.stop) > MAX_STOP_STRINGS:
            raise RequestError("stop", f"stop holds {len(self.stop)} strings, more than "
                               f"{MAX_STOP_STRINGS}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise RequestError("stop", f"stop must hold non-empty strings, got "
                                   f"{type(text).__name__}")
            if len(text) > MAX_STOP_STRING_CHARS:
                raise RequestError("stop", f"stop strings must be at most "
                                   f"{MAX_STOP_STRING_CHARS} characters, got {len(text)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise RequestError("stop_token_ids", f"stop_token_ids holds "
                               f"{len(self.stop_token_ids)} ids, more than {MAX_STOP_TOKEN_IDS}")
        self._check_logit_bias()
        self._check_constraints()

    def _check_constraints(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            check_float(name, getattr(self, name), -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
                    low_open=True)
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise RequestError("allowed_token_ids", "allowed_token_ids must name at least one "
                               "token (or be None)")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise RequestError("bad_words", f"bad_words holds {len(self.bad_words)} words, more "
                               f"than {MAX_BAD_WORDS}")
        for word in self.bad_words:
            if not word.strip() or len(word) > MAX_STOP_STRING_CHARS:
                raise RequestError("bad_words", f"bad_words must hold non-blank words of at "
                                   f"most {MAX_STOP_STRING_CHARS} characters")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                  StructuredOutputs):
            raise RequestError("structured_outputs", "structured_outputs must be a "
                               "StructuredOutputs (or a dict of its fields), got "
                               f"{type(self.structured_outputs).__name__}")

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError("logit_bias", f"logit_bias holds {len(self.logit_bias)} tokens, "
                               f"more than {MAX_LOGIT_BIAS}")
        for token_id, bias in self.logit_bias:
            check_int("logit_bias", token_id, 0, INT32_MAX)
            check_float("logit_bias", bias, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences generated: best_of if given, else n."""
        return self.best_of or self.n


@dataclasses.dataclass(slots=True)
class Logprob:
    """vLLM's Logprob: a token's logprob under the model, its rank in the step's distribution
    (1 = the most likely) and, with a tokenizer, its text on its own."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; recomputes its tokens when readmitted
    SWAPPED = "swapped"  # blocks copied to the host pool; copied back when readmitted
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed inside a step; dropped alone, the others go on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR)


class Request:
    """One sequence being served: its tokens, how far its KV is computed, and its timings.

    Token regions of a request (``num_computed_tokens`` grows as steps run):

        |<------------- prompt ------------->|<---- output ---->|
        |<-- num_computed_tokens -->|<- scheduled this step ->|
    """

    __slots__ = ("request_id", "prompt_token_ids", "output_token_ids", "sampling_params",
                 "seed", "eos_token_ids", "num_computed_tokens", "status", "arrival_time",
                 "first_scheduled_time", "first_token_time", "finish_time", "num_preemptions",
                 "cache_salt", "block_hashes", "num_cached_tokens", "parent_id",
                 "sample_index", "followers", "cumulative_logprob", "logprobs", "stop_reason",
                 "prompt_logprobs", "spec_token_ids", "num_draft_tokens",
                 "num_accepted_draft_tokens", "awaiting_kv", "lora_id", "lora_key",
                 "lora_slot", "pooling")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, *, seed: int, arrival_time: float,
                 eos_token_ids: Sequence[int] = (), cache_salt: str | None = None,
                 lora_id: int | None = None, lora_key: str | None = None):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.seed = seed
        self.eos_token_ids = frozenset(eos_token_ids)  # the model's end-of-sequence ids
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.num_preemptions = 0
        # What stopped it, as vLLM reports it: a stop token id or stop string; None for EOS,
        # the length limit, or while it runs.
        self.stop_reason: int | str | None = None
        self.cache_salt = cache_salt  # requests share cached blocks only under the same salt
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, filled lazily
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.parent_id = request_id  # the user's request id; differs for parallel samples
        self.sample_index = 0
        # Parallel samples waiting for this request's prompt: each samples its first token from
        # the same logits in the step that completes the prompt, then forks its blocks.
        self.followers: list[Request] = []
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, Logprob]] = []  # per output token, when asked for
        # Per prompt token, when asked for: None for the first, then {token id: Logprob} of the
        # prompt's token and the most likely ones at its position (filled as chunks compute).
        self.prompt_logprobs: list[dict[int, Logprob] | None] = (
            [None] if sampling_params.prompt_logprobs is not None else [])
        # Speculative decoding: tokens proposed to follow this request's tokens, verified by
        # its next step (they ride as extra query tokens; the ones the target rejects roll
        # back). Empty while it has none; dropped on preemption.
        self.spec_token_ids: list[int] = []
        self.num_draft_tokens = 0  # drafts its steps verified
        self.num_accepted_draft_tokens = 0  # of those, the ones the target accepted
        # Its prefix is still coming up from a tier below the device (pagedjax.kv_offload.tiers
        # sets it for one schedule, vLLM's WAITING_FOR_REMOTE_KVS): it is not admitted yet.
        self.awaiting_kv = False
        # The LoRA adapter it runs under (None: the base model): its id (the scheduler's
        # device slot key, scheduler.lora_slots), its key in the prefix cache's block hashes
        # (name and weights' version: KV computed under one adapter serves no other), and its
        # slot while it runs.
        self.lora_id = lora_id
        self.lora_key = lora_key
        self.lora_slot = -1
        # A pooling request (embeddings, scores; pagedjax.pooling) runs its prompt only and
        # returns final hidden states instead of tokens: the ones it needs, "last" (the last
        # prompt token's: a prefix cache hit serves the rest) or "all" (every prompt token's:
        # computed whole, no prefix hits); None for a generation request.
        self.pooling: str | None = None

    @property
    def computes_whole_prompt(self) -> bool:
        """Every prompt position must run through the model (no prefix cache hits): the
        request asks for prompt logprobs, or pools every token's state (vLLM's rule)."""
        return self.sampling_params.prompt_logprobs is not None or self.pooling == "all"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_num_tokens(self) -> int:
        """The most tokens this request can ever hold in the KV cache."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if stop <= n:
            return self.prompt_token_ids[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:stop - n]

    def append_output_token(self, token_id: int) -> RequestStatus | None:
        """Appends a sampled token; returns the finished status if the request is now done."""
        self.output_token_ids.append(token_id)
        params = self.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            self.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if len(self.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.value}, "
                f"prompt={self.num_prompt_tokens}, output={self.num_output_tokens}, "
                f"computed={self.num_computed_tokens})")


def make_samples(request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                 seed: int, arrival_time: float, eos_token_ids: Sequence[int] = (),
                 cache_salt: str | None = None, lora_id: int | None = None,
                 lora_key: str | None = None) -> Request:
    """A request and its parallel samples (params.num_samples of them): sample i is
    `request_id#i` with seed + i, the others wait as the first one's followers. lora_id,
    lora_key: the adapter they run under (Request)."""
    num_samples = params.num_samples
    samples = []
    for i in range(num_samples):
        sample = Request(request_id if num_samples == 1 else f"{request_id}#{i}",
                         prompt_token_ids, params, seed=fold_seed(seed + i),
                         arrival_time=arrival_time, cache_salt=cache_salt,
                         eos_token_ids=eos_token_ids, lora_id=lora_id, lora_key=lora_key)
        sample.parent_id, sample.sample_index = request_id, i
        samples.append(sample)
    samples[0].followers = samples[1:]
    return samples[0]


def fold_seed(seed: int) -> int:
    """A 64-bit seed folded into the u32 the sampler keys on; seeds below 2**32 are themselves."""
    seed %= 2**64
    return (seed & 0xFFFFFFFF) ^ (seed >> 32)
