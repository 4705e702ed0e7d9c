"""What happens to requests around a step: admission checks, results, finishing, aborts."""

from __future__ import annotations

from typing import Sequence

from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request, RequestStatus
from scheduler.scheduler import SchedulerConfig, SchedulerOutput, SchedulerState, schedule


def update(state: SchedulerState, output: SchedulerOutput, sampled_ids: Sequence[int],
           now: float, sampled_logprobs: Sequence[float] | None = None,
           top_ids: Sequence[Sequence[int]] | None = None,
           top_logprobs: Sequence[Sequence[float]] | None = None) -> list[Request]:
    """Advances the scheduled requests by the step's result; returns the requests that received
    a new token (finished ones among them, with a finished status and their blocks freed).

    Row i of sampled_ids belongs to output.scheduled[i], then one row per fork follower. A
    scheduled row's token is kept only when its sequence has caught up with all its tokens (the
    last chunk of a prefill, or a decode). top_ids / top_logprobs (rows x K, most likely first)
    feed the requests that asked for logprobs.
    """
    kv = state.kv_manager
    num_scheduled = len(output.scheduled)
    for seq in output.scheduled:
        seq.request.num_computed_tokens = seq.start + seq.num_new_tokens
        kv.publish_full_blocks(seq.request)
        kv.free_out_of_window(seq.request)
    rows = [(seq.request, i) for i, seq in enumerate(output.scheduled)
            if seq.request.num_computed_tokens == seq.request.num_tokens]
    for k, (leader, follower) in enumerate(output.forks):
        kv.fork(leader, follower)  # before the leader appends: it may finish and free
        follower.num_computed_tokens = leader.num_computed_tokens
        follower.status = RequestStatus.RUNNING
        follower.first_scheduled_time = leader.first_scheduled_time
        state.running.append(follower)
        state.num_followers -= 1
        rows.append((follower, num_scheduled + k))
    for leader, _ in output.forks:
        leader.followers = []
    advanced = []
    any_finished = False
    for request, row in rows:
        if request.first_token_time is None:
            request.first_token_time = now
        token_id = int(sampled_ids[row])
        if sampled_logprobs is not None:
            request.cumulative_logprob += float(sampled_logprobs[row])
            num_top = request.sampling_params.logprobs
            if num_top is not None:
                top = {int(t): float(lp) for t, lp in zip(top_ids[row][:num_top],
                                                         top_logprobs[row][:num_top])}
                top[token_id] = float(sampled_logprobs[row])
                request.logprobs.append(top)
        status = request.append_output_token(token_id)
        if status is None and request.num_tokens >= state.config.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            _finish(state, request, status, now)
            any_finished = True
        advanced.append(request)
    if any_finished:
        state.running = [r for r in state.running if not r.status.finished]
    return advanced


def _finish(state: SchedulerState, request: Request, status: RequestStatus, now: float) -> None:
    request.status = status
    request.finish_time = now
    state.kv_manager.free(request)
    state.requests.pop(request.request_id, None)


def check_request(state: SchedulerState, request: Request) -> None:
    """Raises ValueError, naming the field and the limit, if request (with its parallel-sample
    followers) can never be served."""
    config = state.config
    for r in [request, *request.followers]:
        if r.request_id in state.requests:
            raise ValueError(f"request_id {r.request_id!r} is already in use")
    if request.num_prompt_tokens < 1:
        raise ValueError("prompt must contain at least one token")
    if request.max_num_tokens > config.max_model_len:
        raise ValueError(
            f"prompt length ({request.num_prompt_tokens}) + max_tokens "
            f"({request.sampling_params.max_tokens}) = {request.max_num_tokens} exceeds "
            f"max_model_len ({config.max_model_len})")
    group = 1 + len(request.followers)
    if group > config.max_num_seqs:
        raise ValueError(f"n / best_of ({group}) exceeds max_num_seqs ({config.max_num_seqs})")
    kv = state.kv_manager
    if not kv.can_ever_fit(request.max_num_tokens):
        raise ValueError(
            f"prompt length + max_tokens = {request.max_num_tokens} tokens needs "
            f"{kv.num_blocks_for(request.max_num_tokens)} KV blocks, more than the whole pool "
            f"({kv.pool.num_usable_blocks} blocks of {kv.block_size} tokens)")


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


class Scheduler:
    """Convenience object holding a SchedulerState; every method is one of the free functions."""

    def __init__(self, config: SchedulerConfig, num_blocks: int, block_size: int,
                 cache_key: bytes = b"", num_host_blocks: int = 0,
                 sliding_window: int | None = None):
        kv_manager = KVCacheManager(num_blocks, block_size, cache_key=cache_key,
                                    enable_prefix_caching=config.enable_prefix_caching,
                                    num_host_blocks=num_host_blocks,
                                    sliding_window=sliding_window)
        self.state = SchedulerState(config, kv_manager)

    @property
    def config(self) -> SchedulerConfig:
        return self.state.config

    @property
    def kv_manager(self) -> KVCacheManager:
        return self.state.kv_manager

    def check_request(self, request: Request) -> None:
        check_request(self.state, request)

    def add_request(self, request: Request) -> None:
        add_request(self.state, request)

    def schedule(self, now: float) -> SchedulerOutput:
        self.state, output = schedule(self.state, now)
        return output

    def update(self, output: SchedulerOutput, sampled_ids: Sequence[int], now: float,
               sampled_logprobs: Sequence[float] | None = None, top_ids=None,
               top_logprobs=None) -> list[Request]:
        return update(self.state, output, sampled_ids, now, sampled_logprobs, top_ids,
                      top_logprobs)

    def abort(self, request_id: str, now: float,
              status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> Request | None:
        return abort_request(self.state, request_id, now, status)

    def has_unfinished(self) -> bool:
        return bool(self.state.requests)
