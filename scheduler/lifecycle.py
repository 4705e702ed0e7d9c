"""What happens to requests around a step: admission checks, results, finishing, aborts."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from pagedjax.scheduler.async_steps import take_placeholder
from pagedjax.scheduler.errors import RequestError
from pagedjax.scheduler.request import Logprob, Request, RequestStatus
from pagedjax.scheduler.state import SchedulerOutput, SchedulerState


def update(state: SchedulerState, output: SchedulerOutput, sampled_ids, now: float,
           sampled_logprobs=None, top_ids=None, top_logprobs=None, sampled_ranks=None,
           on_token: Callable[[Request], RequestStatus | None] | None = None) -> list[Request]:
    """Advances the scheduled requests by the step's result; returns the requests that received
    a new token (finished ones among them, with a finished status and their blocks freed).

    Row i of sampled_ids belongs to output.scheduled[i], then one row per fork follower. A
    scheduled row's token is kept only when its sequence has caught up with all its tokens (the
    last chunk of a prefill, or a decode). top_ids / top_logprobs (rows x K, most likely first)
    and sampled_ranks (each sampled token's rank, 1 = the most likely) feed the requests that
    asked for logprobs: one {token id: Logprob} a token, its top ones and the sampled one.

    A step that verified speculative drafts has 2-D results, a row's tokens at [i, :n] (-1
    after them; its logprobs likewise, one axis more): its accepted drafts, then the target's
    own token. Its num_computed_tokens stops after the accepted drafts (the rejected ones roll
    back: their blocks are freed, their slots overwritten by a later step; nothing past the
    computed tokens is ever published) and its tokens are appended one at a time, so that it
    stops exactly where plain decoding would. on_token(request), called after each appended
    token (the engine's stop strings and grammars), may return a finished status that ends the
    request there.

    Async scheduling (scheduler.async_steps) updates a step after the next one was scheduled:
    a row's placeholder token is taken back before its real token is appended; a request
    aborted since gets nothing, and one preempted since gets its token but keeps the state its
    preemption gave it (it recomputes, or swaps back in, with the token).
    """
    speculative = np.ndim(sampled_ids) == 2
    for seq in output.scheduled:
        take_placeholder(seq.request)
    held = [seq.request.status is RequestStatus.RUNNING for seq in output.scheduled]
    _roll_back_rejected(state, output, sampled_ids, held)
    rows = [(seq.request, i) for i, seq in enumerate(output.scheduled)
            if not seq.request.status.finished
            and seq.start + seq.num_new_tokens >= seq.request.num_tokens]
    rows += _fork_followers(state, output)
    advanced, finished = [], []
    for request, row in rows:
        if request.first_token_time is None:
            request.first_token_time = now
        tokens = sampled_ids[row]
        for j in range(int(np.count_nonzero(tokens >= 0)) if speculative else 1):
            at = (row, j) if speculative else row
            if sampled_logprobs is not None:
                _record_logprobs(request, int(sampled_ids[at]), float(sampled_logprobs[at]),
                                 top_ids[at], top_logprobs[at],
                                 None if sampled_ranks is None else int(sampled_ranks[at]))
            if _append(state, request, int(sampled_ids[at]), now, on_token):
                finished.append(request)
                break
        advanced.append(request)
    _settle(state, output, finished, held)
    return advanced


def _roll_back_rejected(state: SchedulerState, output: SchedulerOutput, sampled_ids,
                        held: list[bool]) -> None:
    """Each scheduled request's computed tokens after the step: all it ran, less the drafts
    the target rejected (their blocks trimmed); drafts are spent either way. Only the requests
    still held (running)."""
    for i, seq in enumerate(output.scheduled):
        request = seq.request
        if not held[i]:
            continue
        end = seq.start + seq.num_new_tokens
        num_drafts = len(seq.drafts)
        if num_drafts:
            accepted = int(np.count_nonzero(sampled_ids[i] >= 0)) - 1
            _count_accepted(state, num_drafts, accepted)
            request.num_draft_tokens += num_drafts
            request.num_accepted_draft_tokens += accepted
            end -= num_drafts - accepted
        request.spec_token_ids = []
        request.num_computed_tokens = end
        if num_drafts:
            state.kv_manager.trim(request)


def _fork_followers(state: SchedulerState, output: SchedulerOutput) -> list[tuple[Request, int]]:
    """The step's fork followers join the running queue on their leaders' blocks; their rows."""
    rows = []
    for k, (leader, follower) in enumerate(output.forks):
        state.kv_manager.fork(leader, follower)  # before the leader appends: it may finish
        follower.num_computed_tokens = leader.num_computed_tokens
        follower.status = RequestStatus.RUNNING
        follower.first_scheduled_time = leader.first_scheduled_time
        state.running.append(follower)
        state.num_followers -= 1
        rows.append((follower, len(output.scheduled) + k))
    for leader, _ in output.forks:
        leader.followers = []
    return rows


def _settle(state: SchedulerState, output: SchedulerOutput, finished: list[Request],
            held: list[bool]) -> None:
    """After the tokens are appended: full blocks published (a block's hash is of its tokens,
    accepted drafts among them), blocks out of a window freed, then the finished requests'
    blocks released. A request that stopped inside its accepted drafts computed past its last
    token: it counts what plain decoding would have. (Only the requests held, running, when
    the update began: see update.)"""
    kv = state.kv_manager
    for i, seq in enumerate(output.scheduled):
        request = seq.request
        if not held[i]:
            continue
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
        kv.publish_full_blocks(request)
        kv.free_out_of_window(request)
    for request in finished:
        _release(state, request)
    for i, seq in enumerate(output.scheduled):  # preempted after its step was dispatched,
        if not held[i] and seq.request in finished:  # then finished by its token
            state.waiting.remove(seq.request)
    if finished:
        state.running = [r for r in state.running if not r.status.finished]


def _append(state: SchedulerState, request: Request, token_id: int, now: float,
            on_token) -> bool:
    """Appends one token to request; True when that finished it (its status set, its blocks
    still held: update releases them)."""
    status = request.append_output_token(token_id)
    if status is None and request.num_tokens >= state.config.max_model_len:
        status = RequestStatus.FINISHED_LENGTH
    if status is not None:
        request.status, request.finish_time = status, now
    if on_token is not None:
        stop = on_token(request)
        if stop is not None and status is None:
            status = stop
            request.status, request.finish_time = status, now
    return status is not None


def _record_logprobs(request: Request, token_id: int, logprob: float, top_ids, top_logprobs,
                     rank: int | None) -> None:
    request.cumulative_logprob += logprob
    num_top = request.sampling_params.logprobs
    if num_top is not None:
        top = {int(t): Logprob(float(lp), r) for r, (t, lp) in enumerate(
            zip(top_ids[:num_top], top_logprobs[:num_top]), start=1)}
        if token_id not in top:
            top[token_id] = Logprob(logprob, rank)
        request.logprobs.append(top)


def _count_accepted(state: SchedulerState, num_drafts: int, accepted: int) -> None:
    state.num_spec_drafts += 1
    state.num_spec_draft_tokens += num_drafts
    state.num_spec_accepted_tokens += accepted
    per_position = state.spec_accepted_per_position
    per_position.extend([0] * (num_drafts - len(per_position)))
    for j in range(accepted):
        per_position[j] += 1


def _finish(state: SchedulerState, request: Request, status: RequestStatus, now: float) -> None:
    request.status = status
    request.finish_time = now
    _release(state, request)


def _release(state: SchedulerState, request: Request) -> None:
    """A finished request's blocks back to the pool, and it out of the scheduler's requests."""
    state.kv_manager.free(request)
    state.requests.pop(request.request_id, None)


def check_admission(state: SchedulerState, num_samples: int, num_prompt_tokens: int,
                    max_tokens: int, request_ids: Sequence[str] = ()) -> None:
    """Raises RequestError, naming the field and the limit, if a request with these numbers
    (request_ids: its samples' ids, when already chosen) can never be served. Needs no Request:
    the engine calls it before building anything."""
    config = state.config
    for request_id in request_ids:
        if request_id in state.requests:
            raise RequestError("request_id", f"request_id {request_id!r} is already in use")
    if num_prompt_tokens < 1:
        raise RequestError("prompt_token_ids", "prompt_token_ids must contain at least one token")
    total = num_prompt_tokens + max_tokens
    if total > config.max_model_len:
        field = "max_tokens" if max_tokens >= config.max_model_len else "prompt_token_ids"
        raise RequestError(field, f"{field}: prompt length ({num_prompt_tokens}) + max_tokens "
                           f"({max_tokens}) = {total} exceeds max_model_len "
                           f"({config.max_model_len})")
    if num_samples > config.max_num_seqs:
        raise RequestError("n", f"n / best_of ({num_samples}) exceeds max_num_seqs "
                           f"({config.max_num_seqs})")
    kv = state.kv_manager
    if not kv.can_ever_fit(total):
        raise RequestError("max_tokens", f"max_tokens: prompt length + max_tokens = {total} "
                           f"tokens needs {kv.num_blocks_for(total)} KV blocks, more than the "
                           f"whole pool ({kv.pool.num_usable_blocks} blocks of {kv.block_size} "
                           f"tokens)")


def check_request(state: SchedulerState, request: Request) -> None:
    """check_admission for a built request and its parallel-sample followers."""
    samples = [request, *request.followers]
    check_admission(state, len(samples), request.num_prompt_tokens,
                    request.sampling_params.max_tokens, [r.request_id for r in samples])


def add_request(state: SchedulerState, request: Request) -> None:
    """Queues a request (and its followers), or raises ValueError and changes nothing."""
    check_request(state, request)
    for r in [request, *request.followers]:
        state.requests[r.request_id] = r
    state.waiting.append(request)


def abort_request(state: SchedulerState, request_id: str, now: float,
                  status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
    """Finishes a request at once with status (aborted, or stopped by a stop string the engine
    found in its text) and frees its blocks; unknown ids are a no-op. Aborting a leader before
    its fork aborts its followers too."""
    if not status.finished:
        raise ValueError(f"status must be a finished status, got {status}")
    request = state.requests.get(request_id)
    if request is None:
        return None
    running = request.status == RequestStatus.RUNNING
    if running:
        state.running.remove(request)
    elif request in state.waiting:
        state.waiting.remove(request)
    else:  # a follower not forked yet
        leader = next(r for r in state.requests.values() if request in r.followers)
        leader.followers.remove(request)
        if leader.status == RequestStatus.RUNNING:
            state.num_followers -= 1
    for follower in request.followers:
        _finish(state, follower, RequestStatus.FINISHED_ABORTED, now)
    if running:
        state.num_followers -= len(request.followers)
    request.followers = []
    _finish(state, request, status, now)
    return request


def requeue(state: SchedulerState, request: Request) -> None:
    """Puts a running request back at the head of the queue to recompute its KV (a step that
    failed left its blocks in an unknown state)."""
    if request.status != RequestStatus.RUNNING:
        return
    state.kv_manager.free(request)
    state.num_recomputed_tokens += request.num_computed_tokens
    request.num_computed_tokens = 0
    request.spec_token_ids = []
    request.status = RequestStatus.PREEMPTED
    state.running.remove(request)
    state.num_followers -= len(request.followers)
    state.waiting.appendleft(request)
