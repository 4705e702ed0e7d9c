"""What a step gives back on the host (ModelRunner.fetch), by name: the sampler's arrays for the
step's real rows, and the forward's prompt logprobs and pooled hidden states when it has them;
and a step begun (LLMEngine.begin_step) whose results are not in yet.

A NamedTuple, so a caller may still unpack it in order; the engine reads it by name.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pagedjax.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from pagedjax.engine.runner import PendingStep


class StepResults(NamedTuple):
    sampled_ids: np.ndarray  # i32[B, 1 + K]: each real row's sampled (and accepted) tokens
    logprobs: np.ndarray  # f32: the sampled tokens' logprobs
    top_ids: np.ndarray  # i32: each row's top logprob ids (max_logprobs wide)
    top_logprobs: np.ndarray  # f32: their logprobs
    ranks: np.ndarray  # i32: the sampled tokens' ranks
    prompt: tuple | None  # the prompt logprob arrays (prompt_logprobs), or None
    pooled: np.ndarray | None  # f32[rows, D]: the pooled rows' hidden states, or None


@dataclasses.dataclass
class StartedStep:
    """A step begin_step dispatched: its schedule, when it began, the device step in flight
    (or the error that stopped it before the device)."""

    output: SchedulerOutput
    start: float
    pending: PendingStep | None
    error: Exception | None = None
