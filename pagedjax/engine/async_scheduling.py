"""Async scheduling (vLLM's --async-scheduling): the host schedules, plans and dispatches step
N + 1 while the device runs step N.

Once step N is dispatched, the scheduler is advanced as if it had run (scheduler.async_steps:
each row that samples holds a placeholder for its token) and step N + 1 is scheduled and
dispatched; its placeholder tokens are read from step N's sampled ids on the device
(ModelRunner.dispatch_forward's `previous`), so no token makes the round trip to the host
between the two. Only then are step N's results fetched and its requests advanced (detokenized,
stopped, streamed). JAX runs the two steps in order (the KV cache is threaded through them), so
the device never waits for the host's part of a step unless that part is longer than the step.

What differs from synchronous stepping is only which step a request's row rides in, never its
tokens: a request that finishes in step N (a stop token or string, EOS) may have a row in step
N + 1, whose result is dropped (its KV was written into its own blocks, past its end); one
aborted meanwhile likewise; a request step N certainly finishes (max_tokens, max_model_len) gets
no row; a request admitted after step N + 1 was scheduled waits for step N + 2. Step N + 1 is
not scheduled ahead, and the engine steps synchronously for that step, when step N's requests
need their new token on the host before their next step: repetition/presence/frequency
penalties (the plan carries their tokens), a grammar or a bad word of several tokens (the mask
is built from the tokens), or forks of n > 1 (the followers join at N's update), or when step N
failed before the device (its rows are retried one at a time).

A step whose results cannot be fetched (it failed on the device) while the next was dispatched
after it: the next is waited for and dropped, and the running requests recompute in a fresh KV
cache (StepRecovery.recompute_running; a request that keeps failing fails alone).

A data-parallel engine runs each replica's async scheduling (begin every replica's, then finish
every replica's), so the replicas' devices and the host overlap as well.
"""

from __future__ import annotations

from pagedjax.engine.step_recovery import is_device_oom
from pagedjax.scheduler.async_steps import advance_ahead, drop_placeholders


class AsyncScheduling:
    """An LLMEngine's step() under async scheduling: at most one step in flight between two
    calls, dispatched ahead of the results of the step before it."""

    def __init__(self, engine):
        self.engine = engine
        self.in_flight = None  # the engine's StartedStep dispatched ahead, not yet finished

    def step(self, final_only: bool = False) -> list:
        return self.finish(self.begin(), final_only)

    def begin(self):
        """The first half of step(): the step to finish (the one in flight, or one dispatched
        now) and the step dispatched ahead of its results (None when it cannot be); None when
        there is nothing to step. (A data-parallel engine begins every replica's before
        finishing any.)"""
        current, self.in_flight = self.in_flight, None
        if current is None:
            current = self.engine.begin_step()
            if current is None:
                return None
        return current, self._begin_ahead(current)

    def finish(self, begun, final_only: bool = False) -> list:
        """The second half of step(): waits for begin()'s step and advances its requests; the
        step dispatched ahead stays in flight for the next call."""
        if begun is None:
            return []
        engine = self.engine
        current, ahead = begun
        if ahead is None:
            return engine.finish_step(current, final_only)
        try:
            results = engine.runner.fetch(current.pending)
        except Exception as error:  # noqa: BLE001 - the step failed on the device
            self._drop(ahead)
            if is_device_oom(error):
                engine.stats.num_oom += 1
            return engine.recovery.recompute_running(current.output, error)
        try:
            outputs = engine.complete_step(current, results, final_only)
        except BaseException:
            self._drop(ahead)
            raise
        self.in_flight = ahead
        engine.stats.num_ahead_steps += 1
        return outputs

    def can_run_ahead(self, started) -> bool:
        """Whether the step after `started` can be scheduled before its results (see the
        module's docstring)."""
        if started.error is not None or started.output.forks:
            return False
        masks = self.engine.token_masks
        return not any(seq.request.sampling_params.uses_penalties
                       or masks.needs_history(seq.request) for seq in started.output.scheduled)

    def _begin_ahead(self, current):
        """Advances the scheduler past `current` and dispatches the step after it (None when it
        cannot, or nothing is left to schedule)."""
        if not self.can_run_ahead(current):
            return None
        engine = self.engine
        try:
            advance_ahead(engine.scheduler.state, current.output)
            return engine.begin_step(after=current)
        except BaseException:
            self._drop(current)
            raise

    def _drop(self, started) -> None:
        """Waits for a dispatched step (its device work done or failed) and forgets it; every
        placeholder goes with it."""
        if started is not None and started.pending is not None:
            try:
                self.engine.runner.fetch(started.pending)
            except Exception:  # noqa: BLE001 - its results are dropped either way
                pass
        drop_placeholders(self.engine.scheduler.state.requests.values())

    def settle(self) -> list:
        """Finishes the step dispatched ahead, if any (its outputs): nothing stays in flight
        (pausing settles so)."""
        ahead, self.in_flight = self.in_flight, None
        return [] if ahead is None else self.finish((ahead, None))

    def abandon(self) -> None:
        """Forgets the step in flight (the engine starts over: LLMEngine.fail_all)."""
        started, self.in_flight = self.in_flight, None
        self._drop(started)
