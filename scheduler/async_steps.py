"""Async scheduling's bookkeeping: the next step is scheduled while this one runs on the device.

Once a step is dispatched (and before its results are in), `advance_ahead(state, output)` makes
the state look as if the step had run: each scheduled row's computed tokens advance to the end
of its chunk (its full blocks published, its blocks out of a sliding window freed, as the
step's update would), and a row that samples gets a placeholder output token, -(row + 1),
whose value the device fills from that step's sampled ids (row `row` of its sampler's output:
pagedjax.engine.runner's _fill_placeholders). The next `schedule` then sees every such request
as a decode of one more token, unchanged; `build_plan` copies the placeholder into the plan's
token_ids, and the engine fills it on the device.
`update` of the step (lifecycle.update) takes the placeholder back before it appends the real
token. A request its step certainly finishes (max_tokens or max_model_len reached) gets no
placeholder: nothing is scheduled for it (schedule_running skips a row with nothing to compute).

Between two engine steps no placeholder exists: they live from advance_ahead to the update of
the step they stand for, so detokenization, stop strings, grammars and outputs see real tokens.
"""

from __future__ import annotations

from typing import Iterable

from pagedjax.scheduler.request import Request, RequestStatus
from pagedjax.scheduler.state import SchedulerOutput, SchedulerState


def placeholder(row: int) -> int:
    """The output token standing for row `row`'s sampled token of the step in flight."""
    return -(row + 1)


def certainly_finishes(state: SchedulerState, request: Request) -> bool:
    """Whether the token its step samples ends request whatever it is: max_tokens, or
    max_model_len, reached."""
    return (request.num_output_tokens + 1 >= request.sampling_params.max_tokens
            or request.num_tokens + 1 >= state.config.max_model_len)


def advance_ahead(state: SchedulerState, output: SchedulerOutput) -> None:
    """After output's step is dispatched, before its results: its rows computed through their
    chunks, and a placeholder token for each row that samples and may go on (see the module's
    docstring). A step with forks cannot be advanced (its followers join at its update)."""
    if output.forks:
        raise ValueError("a step with forks cannot be advanced ahead of its results")
    for row, seq in enumerate(output.scheduled):
        request = seq.request
        if request.status is not RequestStatus.RUNNING:
            continue
        end = seq.start + seq.num_new_tokens
        if seq.drafts:
            raise ValueError("a step with speculative drafts cannot be advanced ahead")
        samples = end >= request.num_tokens
        request.num_computed_tokens = end
        # As the step's update will: its full blocks published, blocks out of a window freed
        # (a later step reusing one runs after this one on the device).
        state.kv_manager.publish_full_blocks(request)
        state.kv_manager.free_out_of_window(request)
        if samples and not certainly_finishes(state, request):
            request.output_token_ids.append(placeholder(row))


def take_placeholder(request: Request) -> bool:
    """Removes request's placeholder token, if it has one (its step's update is about to append
    the real token); whether it had one."""
    tokens = request.output_token_ids
    if tokens and tokens[-1] < 0:
        tokens.pop()
        return True
    return False


def drop_placeholders(requests: Iterable[Request]) -> int:
    """Removes every placeholder (the step in flight was abandoned); how many there were."""
    return sum(take_placeholder(request) for request in requests)
