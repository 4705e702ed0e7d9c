"""What a step gives back on the host (ModelRunner.fetch), by name: the sampler's arrays for the
step's real rows, and the forward's prompt logprobs and pooled hidden states when it has them.

A NamedTuple, so a caller may still unpack it in order; the engine reads it by name.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class StepResults(NamedTuple):
    sampled_ids: np.ndarray  # i32[B, 1 + K]: each real row's sampled (and accepted) tokens
    logprobs: np.ndarray  # f32: the sampled tokens' logprobs
    top_ids: np.ndarray  # i32: each row's top logprob ids (max_logprobs wide)
    top_logprobs: np.ndarray  # f32: their logprobs
    ranks: np.ndarray  # i32: the sampled tokens' ranks
    prompt: tuple | None  # the prompt logprob arrays (prompt_logprobs), or None
    pooled: np.ndarray | None  # f32[rows, D]: the pooled rows' hidden states, or None
