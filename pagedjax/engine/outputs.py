"""What the engine hands back for each request."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from pagedjax.scheduler import Request
from pagedjax.scheduler.request import Logprob


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    # Speculative decoding, over the samples: drafts verified and the ones accepted (with a
    # prediction, OpenAI's accepted_prediction_tokens; the rest its rejected ones).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    @classmethod
    def of(cls, samples: Sequence[Request], finished: bool) -> "RequestMetrics":
        """A request's metrics from its samples (finished: all of them are)."""
        leader = samples[0]
        first_tokens = [s.first_token_time for s in samples if s.first_token_time is not None]
        finishes = [s.finish_time for s in samples if s.finish_time is not None]
        return cls(leader.arrival_time, leader.first_scheduled_time,
                   min(first_tokens) if first_tokens else None,
                   max(finishes) if finished else None,
                   sum(s.num_preemptions for s in samples), leader.num_cached_tokens,
                   sum(s.num_draft_tokens for s in samples),
                   sum(s.num_accepted_draft_tokens for s in samples))

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    index: int  # which sample (0 .. n-1)
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or "error" once finished
    cumulative_logprob: float  # sum of the model's logprobs of token_ids
    # Per token, when asked for: {token id: Logprob} of the most likely tokens and the chosen one.
    logprobs: list[dict[int, Logprob]] | None = None
    # Detokenized output when the engine has a tokenizer (cut at a stop string; while a request
    # runs, a tail that could still grow into a stop string is held back).
    text: str | None = None
    # What stopped it (vLLM's stop_reason): the stop token id or stop string; None for EOS,
    # the length limit, or while it runs.
    stop_reason: int | str | None = None
    # Tokens the sample has generated so far: len(token_ids) in a cumulative output; in a DELTA
    # one (SamplingParams.output_kind) token_ids, logprobs and text are only what is new.
    num_tokens: int = -1

    def __post_init__(self):
        if self.num_tokens < 0:
            object.__setattr__(self, "num_tokens", len(self.token_ids))


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]  # n of them; best_of keeps the n most likely once finished
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    error: str | None = None  # why it failed inside a step (finish_reason "error")
    cache_salt: str | None = None  # the request's, as given
    # vLLM's prompt_logprobs, when asked for: None for the first prompt token, then per token
    # {token id: Logprob} of the token itself and the most likely ones at its position (the
    # positions computed so far while a long prompt is still being prefilled).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # The weights' version its tokens were sampled under (LLMEngine.update_weights): one, or
    # the list of them for a request an update with mode "keep" carried over.
    weight_version: str | list[str] | None = None
    lora_request: object = None  # the pagedjax.LoRARequest it ran under (None: the base model)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (vLLM's field)."""
        return self.metrics.num_cached_tokens

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def output_token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @classmethod
    def from_samples(cls, samples: Sequence[Request], n: int,
                     texts: dict[str, str] | None = None,
                     prompt: str | None = None, error: str | None = None,
                     weight_version: str | list[str] | None = None,
                     lora_request=None) -> "RequestOutput":
        """One request's output from its samples (one, or best_of >= n parallel ones); texts
        maps a sample's request_id to its detokenized output."""
        texts = texts or {}
        leader = samples[0]
        finished = all(s.status.finished for s in samples)
        chosen = list(samples)
        if finished and len(samples) > n:
            chosen = sorted(samples, key=lambda s: -s.cumulative_logprob)[:n]
        outputs = [CompletionOutput(index=i, token_ids=list(s.output_token_ids),
                                    finish_reason=s.status.value if s.status.finished else None,
                                    cumulative_logprob=s.cumulative_logprob,
                                    logprobs=(list(s.logprobs) if s.sampling_params.logprobs
                                              is not None else None),
                                    text=texts.get(s.request_id),
                                    stop_reason=s.stop_reason if s.status.finished else None)
                   for i, s in enumerate(chosen)]
        return cls(request_id=leader.parent_id, prompt_token_ids=list(leader.prompt_token_ids),
                   outputs=outputs, finished=finished,
                   metrics=RequestMetrics.of(samples, finished), prompt=prompt,
                   error=error, cache_salt=leader.cache_salt, weight_version=weight_version,
                   lora_request=lora_request,
                   prompt_logprobs=(list(leader.prompt_logprobs) if
                                    leader.sampling_params.prompt_logprobs is not None else None))


@dataclasses.dataclass(frozen=True)
class PoolingOutput:
    data: np.ndarray  # f32: [D] a sequence's vector, [labels], or [tokens, D or labels]


@dataclasses.dataclass(frozen=True)
class PoolingRequestOutput:
    """A pooling request's output (vLLM's), once its prompt is computed: outputs.data;
    finish_reason "stop" (or "error", with error saying why, "abort")."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None
    error: str | None = None
    finish_reason: str | None = "stop"

    @property
    def num_cached_tokens(self) -> int:
        return self.metrics.num_cached_tokens

    @classmethod
    def from_sample(cls, sample: Request, data: np.ndarray, prompt: str | None = None,
                    error: str | None = None) -> "PoolingRequestOutput":
        finished = sample.status.finished
        reason = None if not finished else "stop" if sample.status.value in (
            "stop", "length") else sample.status.value
        metrics = RequestMetrics(sample.arrival_time, sample.first_scheduled_time,
                                 sample.first_token_time, sample.finish_time,
                                 sample.num_preemptions, sample.num_cached_tokens)
        return cls(sample.parent_id, PoolingOutput(data), list(sample.prompt_token_ids),
                   finished, metrics, prompt, error, reason)


# what an engine's step hands back for a request: a generation's output or a pooling one's
EngineOutput = RequestOutput | PoolingRequestOutput
