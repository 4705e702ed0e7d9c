"""What the engine hands back for each request."""

from __future__ import annotations

import dataclasses

from scheduler import Request


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finish_time: float | None
    num_preemptions: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def ttft(self) -> float | None:
        """Time to first token, seconds."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    metrics: RequestMetrics

    @classmethod
    def from_request(cls, request: Request) -> "RequestOutput":
        finished = request.status.finished
        return cls(
            request_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids), finished=finished,
            finish_reason=request.status.value if finished else None,
            metrics=RequestMetrics(request.arrival_time, request.first_scheduled_time,
                                   request.first_token_time, request.finish_time,
                                   request.num_preemptions, request.num_cached_tokens))
