"""The plan's per-token output rows: the query tokens whose extra results a step returns
besides the sampled tokens (BatchPlan.prompt_targets for prompt logprobs, BatchPlan.pooling_rows
for pooling requests' hidden states), for rows laid out back to back."""

from __future__ import annotations

import numpy as np


def pooling_rows(scheduled, padded_tokens: int) -> np.ndarray:
    """The plan's pooling_rows (see BatchPlan) for rows laid out back to back: a pooling
    request's prompt tokens of this step ("all"), or its last prompt token ("last")."""
    rows = None
    offset = 0
    for request, start, num_new in scheduled:
        if request.pooling is not None:
            last = min(start + num_new, request.num_prompt_tokens)
            first = last - 1 if request.pooling == "last" else start
            if start < last and (request.pooling == "all" or last == request.num_prompt_tokens):
                if rows is None:
                    rows = np.zeros(padded_tokens, np.int32)
                rows[offset + first - start:offset + last - start] = 1
        offset += num_new
    return np.zeros(0, np.int32) if rows is None else rows


def prompt_targets(scheduled, padded_tokens: int) -> np.ndarray:
    """The plan's prompt_targets (see BatchPlan) for rows laid out back to back: a query token at
    position p targets prompt token p + 1 when its request asks for prompt logprobs and has no
    entry for p + 1 yet."""
    targets = None
    offset = 0
    for request, start, num_new in scheduled:
        if request.sampling_params.prompt_logprobs is not None:
            first = max(start, len(request.prompt_logprobs) - 1)
            last = min(start + num_new, request.num_prompt_tokens - 1)
            if first < last:
                if targets is None:
                    targets = np.full(padded_tokens, -1, np.int32)
                targets[offset + first - start:offset + last - start] = \
                    request.prompt_token_ids[first + 1:last + 1]
        offset += num_new
    return np.zeros(0, np.int32) if targets is None else targets
