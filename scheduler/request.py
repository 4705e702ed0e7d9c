"""Requests and their sampling parameters: plain Python, validated on construction."""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops.

    temperature == 0 means greedy. top_k == -1 disables top-k; top_p == 1 disables top-p.
    seed makes a request's samples reproducible whatever else is in the batch; with no seed the
    engine draws one from its own seeded generator. n samples share the prompt's KV blocks;
    best_of >= n samples are drawn and the n with the highest cumulative logprob returned.
    Sample i uses seed + i, so it equals the same request run alone with that seed.
    """

    max_tokens: int = 16
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return this many most likely tokens (and the chosen one)
    # Text-level stops (need the engine's tokenizer): the output ends at the first occurrence,
    # which is cut from the text unless include_stop_str_in_output.
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # in the detokenized text

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is not None and (not isinstance(self.best_of, int)
                                         or self.best_of < self.n):
            raise ValueError(f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k != -1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.seed is not None and not (0 <= self.seed < 2**32):
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed!r}")
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop must hold non-empty strings, got {text!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences generated: best_of if given, else n."""
        return self.best_of or self.n


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks freed; recomputes its tokens when readmitted
    SWAPPED = "swapped"  # blocks copied to the host pool; copied back when readmitted
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


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
                 "sample_index", "followers", "cumulative_logprob", "logprobs")

    def __init__(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling_params: SamplingParams, *, seed: int, arrival_time: float,
                 eos_token_ids: Sequence[int] = (), cache_salt: str | None = None):
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
        self.cache_salt = cache_salt  # requests share cached blocks only under the same salt
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, filled lazily
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at first admission
        self.parent_id = request_id  # the user's request id; differs for parallel samples
        self.sample_index = 0
        # Parallel samples waiting for this request's prompt: each samples its first token from
        # the same logits in the step that completes the prompt, then forks its blocks.
        self.followers: list[Request] = []
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] = []  # per output token, when asked for

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
                 cache_salt: str | None = None) -> Request:
    """A request and its parallel samples (params.num_samples of them): sample i is
    `request_id#i` with seed + i, the others wait as the first one's followers."""
    num_samples = params.num_samples
    samples = []
    for i in range(num_samples):
        sample = Request(request_id if num_samples == 1 else f"{request_id}#{i}",
                         prompt_token_ids, params, seed=(seed + i) % 2**32,
                         arrival_time=arrival_time, cache_salt=cache_salt,
                         eos_token_ids=eos_token_ids)
        sample.parent_id, sample.sample_index = request_id, i
        samples.append(sample)
    samples[0].followers = samples[1:]
    return samples[0]
