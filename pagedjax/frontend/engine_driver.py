"""EngineDriver: what serving adds around an LLMEngine's steps, wherever the engine runs (a
thread of the server's process, pagedjax.frontend.async_engine, or a process of its own,
pagedjax.frontend.engine_core): the live requests, admission control against them, one step with
its failures isolated, and the report metrics read after it.

Not thread-safe: one thread drives it (the engine thread, or the engine core's loop).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from typing import Sequence

from pagedjax.engine.memory_budget import memory_in_use
from pagedjax.engine.outputs import EngineOutput
from pagedjax.engine.request_checks import Admission, PromptSpec
from pagedjax.engine.stats import EngineStats
from pagedjax.frontend import admission_control
from pagedjax.frontend.admission_control import AdmissionLimits, Live
from pagedjax.scheduler import Request

logger = logging.getLogger("pagedjax.engine")

__all__ = ["EngineDriver", "StepInfo", "remaining_tokens"]


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What the engine reports after each step (to metrics)."""

    outputs: list[EngineOutput]
    # Wall time of LLMEngine.step (scheduling, the device step, postprocess); None for a report
    # without a step (after an abort, or when the engine falls idle).
    step_time_s: float | None
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float  # used / usable blocks (over all replicas)
    outstanding_tokens: int
    replicas: tuple = ()  # metrics.ReplicaLoad of each engine replica (data parallelism)
    # The engine's running totals after the step (a copy), its clock then, and its device
    # memory: (bytes in use, limit or None, source), memory_budget.memory_in_use's.
    stats: EngineStats | None = None
    time: float = 0.0
    memory: tuple = (0, None, "engine")
    weight_version: str = "0"  # the weights served (LLMEngine.update_weights)


def remaining_tokens(samples: Sequence[Request]) -> int:
    """Tokens these samples may still compute: the prompt not yet prefilled (again, after a
    recompute preemption) and the outputs not yet generated, up to max_tokens."""
    return sum(r.max_num_tokens - r.num_computed_tokens for r in samples
               if not r.status.finished)


class EngineDriver:
    def __init__(self, engine, limits: AdmissionLimits):
        """engine: an LLMEngine (or a data-parallel one); limits: admission control's rules,
        which may be replaced between steps (degradation does)."""
        self.engine = engine
        self.limits = limits
        # request id -> its samples and what admission control counts of it, until it finishes
        self.admitted: dict[str, Live] = {}
        # outstanding_tokens without a pass over every live request each step (a queue of
        # 20,000 made the steps O(queue) each, the whole O(queue^2)): the requests no step has
        # scheduled yet count their whole remaining tokens, kept as a total; those started are
        # summed afresh (the running ones, and the preempted: a few batches' worth)
        self._fresh: dict[str, int] = {}
        self._fresh_tokens = 0
        self._started: set[str] = set()

    def add(self, prompts: Sequence[PromptSpec], streamed: bool) -> list[str]:
        """Queues several requests at once, all or none: each is validated (ValueError naming
        the field) and admission control checks them together (OverloadedError) before any is
        queued; streamed: whether their client streams. Returns their request ids."""
        long_after = self.limits.long_context_threshold

        def admit(admissions: list[Admission]) -> None:
            blocks_for = self.engine.blocks_for
            admission_control.check(self.limits, list(self.admitted.values()), admissions,
                                    streamed, self.engine.load(), blocks_for,
                                    self.outstanding_tokens(),
                                    self._outstanding_blocks(blocks_for))

        ids = self.engine.add_requests(prompts, admit)
        for request_id in ids:
            samples = self.engine.request_groups[request_id]
            self._fresh[request_id] = remaining_tokens(samples)
            self._fresh_tokens += self._fresh[request_id]
            self.admitted[request_id] = Live(samples, streamed, long_after is not None and
                                             samples[0].num_prompt_tokens > long_after)
        return ids

    def abort(self, request_id: str) -> bool:
        """Aborts a live request (its blocks freed); False when it is not live."""
        if self.admitted.pop(request_id, None) is None:
            return False
        self._forget(request_id)
        self.engine.abort(request_id)
        return True

    def _forget(self, request_id: str) -> None:
        self._fresh_tokens -= self._fresh.pop(request_id, 0)
        self._started.discard(request_id)

    def step(self) -> tuple[list[EngineOutput], float]:
        """One engine step: the outputs of the live requests that advanced (one that failed
        inside it carries its error and is finished) and the step's wall time. A step that
        fails beyond one request's part fails what ran; the engine serves on."""
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception as error:  # noqa: BLE001 - fail what ran, serve on
            logger.exception("engine step failed; its requests fail, the engine goes on")
            outputs = self.engine.fail_all(error)
        step_time = time.perf_counter() - start
        live = [out for out in outputs if out.request_id in self.admitted]
        for out in live:
            if out.finished:
                self.admitted.pop(out.request_id, None)
                self._forget(out.request_id)
        return live, step_time

    def has_work(self) -> bool:
        return self.engine.has_work

    def drop_all(self) -> list[str]:
        """Forgets every live request (the engine has stopped); returns their ids."""
        ids = list(self.admitted)
        self.admitted.clear()
        self._fresh.clear()
        self._fresh_tokens = 0
        self._started.clear()
        return ids

    def outstanding_tokens(self) -> int:
        """Tokens the live requests may still compute (remaining_tokens over them all), in
        O(running + preempted) rather than O(live)."""
        for state in self.engine.scheduler_states():
            for request in state.running:
                parent_id = request.parent_id
                if parent_id in self._fresh:
                    self._fresh_tokens -= self._fresh.pop(parent_id)
                    self._started.add(parent_id)
        admitted = self.admitted
        started = sum(remaining_tokens(admitted[i].samples) for i in self._started
                      if i in admitted)
        return self._fresh_tokens + started

    def _outstanding_blocks(self, blocks_for) -> int:
        """KV blocks the live requests may still take: one pool of their remaining tokens
        with one KV cache group; per sample with several (a sliding group's bound is each
        sequence's)."""
        if not self.engine.hybrid_kv_cache:
            return blocks_for(self.outstanding_tokens())
        return sum(blocks_for(r.max_num_tokens - r.num_computed_tokens)
                   for live in self.admitted.values() for r in live.samples
                   if not r.status.finished)

    def report(self, outputs: list[EngineOutput], step_time: float | None) -> StepInfo:
        replicas = tuple(self.engine.load())
        return StepInfo(
            outputs, step_time, sum(r.num_running for r in replicas),
            sum(r.num_waiting for r in replicas), sum(r.num_swapped for r in replicas),
            sum(r.used_blocks for r in replicas) / max(1, sum(r.usable_blocks for r in replicas)),
            self.outstanding_tokens(), replicas, copy.copy(self.engine.stats),
            self.engine.clock(), memory_in_use(self.engine), self.engine.weight_version)
