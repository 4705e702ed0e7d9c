"""AsyncLLMEngine: one LLMEngine stepped on its own thread, driven from asyncio (the server).

The LLMEngine is not thread-safe, so only the engine thread touches it: adds, aborts and
inspections are closures queued to that thread and run between steps; outputs go back to each
request's asyncio queue through its event loop. A step blocks in JAX for milliseconds to seconds;
the event loop keeps accepting and streaming meanwhile.

Admission control (pagedjax.serving.admission_control) runs on the engine thread against the
live requests: a refused request gets OverloadedError at once (the server's HTTP 429, with its
reason) instead of queueing behind minutes of work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable, Sequence

from pagedjax.engine.admission import Admission, PromptSpec
from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import RequestOutput
from pagedjax.serving import admission_control
from pagedjax.serving.admission_control import AdmissionLimits, Live, OverloadedError
from scheduler import Request, SamplingParams

logger = logging.getLogger("pagedjax.engine")

__all__ = ["AsyncLLMEngine", "EngineDeadError", "OverloadedError", "PromptSpec",
           "RequestFailedError", "RequestGroup", "StepInfo"]


class RequestFailedError(RuntimeError):
    """A request failed inside a step and was dropped alone (the engine serves the others)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error or was shut down; no request can be served."""


@dataclasses.dataclass(frozen=True)
class StepInfo:
    """What the engine thread reports after each step (to metrics)."""

    outputs: list[RequestOutput]
    # Wall time of LLMEngine.step (scheduling, the device step, postprocess); None for a report
    # without a step (after an abort, or when the engine falls idle).
    step_time_s: float | None
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_usage: float  # used / usable blocks (over all replicas)
    outstanding_tokens: int
    replicas: tuple = ()  # metrics.ReplicaLoad of each engine replica (data parallelism)


def remaining_tokens(samples: Sequence[Request]) -> int:
    """Tokens these samples may still compute: the prompt not yet prefilled (again, after a
    recompute preemption) and the outputs not yet generated, up to max_tokens."""
    return sum(r.max_num_tokens - r.num_computed_tokens for r in samples
               if not r.status.finished)


class RequestGroup:
    """The outputs of requests added together, in the order the engine produced them; iterate
    until every request has finished. Leaving early (`async with` / `aclose`, e.g. a client that
    went away) aborts the unfinished ones and frees their blocks."""

    def __init__(self, engine: "AsyncLLMEngine", request_ids: list[str], outputs: asyncio.Queue):
        self.engine = engine
        self.request_ids = request_ids
        self._outputs = outputs
        self._unfinished = set(request_ids)

    def __aiter__(self):
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._unfinished.clear()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
        return item

    async def __aenter__(self) -> "RequestGroup":
        return self

    async def __aexit__(self, *exc) -> None:
        self.aclose()

    def aclose(self) -> None:
        for request_id in self._unfinished:
            self.engine.abort_soon(request_id)
        self._unfinished.clear()


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, *, max_outstanding_tokens: int | None = None,
                 limits: AdmissionLimits | None = None,
                 on_step: Callable[[StepInfo], None] | None = None,
                 on_abort: Callable[[str], None] | None = None,
                 idle_wait_s: float = 0.05):
        """limits: admission control's rules (max_outstanding_tokens alone is the token
        budget's shorthand); they may be replaced while serving (degradation does)."""
        if limits is None:
            limits = AdmissionLimits(max_outstanding_tokens=max_outstanding_tokens)
        elif max_outstanding_tokens is not None:
            raise ValueError("give max_outstanding_tokens inside limits, not beside it")
        self.engine = engine
        self.limits = limits
        self.on_step = on_step
        self.on_abort = on_abort
        self.idle_wait_s = idle_wait_s
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._paused = False
        # Engine-thread state: request id -> (its samples, the loop and queue its outputs go to).
        self._live: dict[str, tuple[list[Request], asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._admitted: dict[str, Live] = {}  # request id -> what admission control counts
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> "AsyncLLMEngine":
        self._thread.start()
        return self

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the engine thread after its current step; live requests end with
        EngineDeadError."""
        self._stopped = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def pause(self) -> None:
        """Stops stepping after the current step (requests are still admitted and queued; a
        drain for a rollout, or a test holding requests in flight)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._wake.set()

    @property
    def running(self) -> bool:
        """The engine thread is alive (it may be finishing a step after shutdown)."""
        return self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._stopped and self._thread.is_alive()

    # ---- the asyncio side --------------------------------------------------------------------

    async def call(self, fn: Callable[[LLMEngine], object]):
        """Runs fn(engine) on the engine thread between steps; returns its result or raises
        its exception."""
        if not self.healthy:
            raise EngineDeadError(self._dead_reason())
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def add_requests(self, prompts: Sequence[PromptSpec],
                           streamed: bool = True) -> "RequestGroup":
        """Queues several requests at once, all or none: each is validated (ValueError naming
        the field) and admission control checks them together (OverloadedError) before any is
        queued; streamed: whether their client streams (the non-streamed cap counts the
        others). Their outputs arrive, interleaved, through the returned group."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        long_after = self.limits.long_context_threshold

        def admit(admissions: list[Admission]) -> None:
            blocks_for = self.engine.blocks_for
            admission_control.check(self.limits, list(self._admitted.values()), admissions,
                                    streamed, self.engine.load(), blocks_for,
                                    self._outstanding_tokens(),
                                    self._outstanding_blocks(blocks_for))

        def add(engine: LLMEngine) -> list[str]:
            ids = engine.add_requests(prompts, admit)
            for request_id, spec in zip(ids, prompts):
                samples = engine.request_groups[request_id]
                self._live[request_id] = (samples, loop, outputs)
                self._admitted[request_id] = Live(samples, streamed, long_after is not None and
                                                  samples[0].num_prompt_tokens > long_after)
            return ids

        return RequestGroup(self, await self.call(add), outputs)

    async def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams, *,
                       request_id: str | None = None, prompt_text: str | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """One request's outputs until the finished one (see add_requests)."""
        group = await self.add_requests(
            [PromptSpec(prompt_token_ids, params, request_id, prompt_text, cache_salt)])
        async with group:
            async for out in group:
                yield out

    async def abort(self, request_id: str) -> None:
        await self.call(lambda engine: self._abort(request_id))

    def abort_soon(self, request_id: str) -> None:
        """Aborts a request from any thread without waiting (the engine thread does it before
        its next step)."""
        if self.healthy:
            self._commands.put((lambda engine: self._abort(request_id), None))
            self._wake.set()

    # ---- the engine thread -------------------------------------------------------------------

    def _abort(self, request_id: str) -> None:
        self._admitted.pop(request_id, None)
        if self._live.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            if self.on_abort is not None:
                self.on_abort(request_id)

    def _outstanding_tokens(self) -> int:
        return sum(remaining_tokens(samples) for samples, _, _ in self._live.values())

    def _outstanding_blocks(self, blocks_for) -> int:
        """KV blocks the live requests may still take: one pool of their remaining tokens
        with one KV cache group; per sample with several (a sliding group's bound is each
        sequence's)."""
        if not self.engine.hybrid_kv_cache:
            return blocks_for(self._outstanding_tokens())
        return sum(blocks_for(r.max_num_tokens - r.num_computed_tokens)
                   for samples, _, _ in self._live.values() for r in samples
                   if not r.status.finished)

    def _drain(self) -> int:
        """Runs the queued commands; returns how many ran."""
        num_run = 0
        while True:
            try:
                fn, future = self._commands.get_nowait()
            except queue.Empty:
                return num_run
            num_run += 1
            if future is None:
                fn(self.engine)
                continue
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the caller
                future.set_exception(e)

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Hands (request id, output or error) pairs to their callers' event loops: one wakeup
        per loop, not one per output."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            _, loop, outputs = self._live[request_id]
            by_loop.setdefault(loop, []).append((request_id, outputs, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the callers' loop is closed: nobody is listening
                for request_id, _, _ in batch:
                    self._abort(request_id)

    def _run(self) -> None:
        engine = self.engine
        try:
            idle_reported = False
            while not self._stopped:
                changed = self._drain()
                if self._paused or not engine.has_unfinished():
                    if changed or not idle_reported:  # gauges follow aborts and idleness
                        self._report([], None)
                        idle_reported = True
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                idle_reported = False
                start = time.perf_counter()
                try:
                    outputs = engine.step()
                except Exception as error:  # noqa: BLE001 - fail what ran, serve on
                    logger.exception("engine step failed; its requests fail, the engine goes on")
                    outputs = engine.fail_all(error)
                step_time = time.perf_counter() - start
                self._report(outputs, step_time)  # first: a caller who has its output
                # finds it in the metrics and the trace
                live = [out for out in outputs if out.request_id in self._live]
                self._deliver([(out.request_id, RequestFailedError(
                    f"request {out.request_id} failed inside a step and was dropped: "
                    f"{out.error}") if out.error is not None else out) for out in live])
                for out in live:
                    if out.finished:
                        self._live.pop(out.request_id, None)
                        self._admitted.pop(out.request_id, None)
        except BaseException as e:  # noqa: BLE001 - the engine is dead; tell every caller
            self.error = e
        finally:
            self._fail_all()

    def _report(self, outputs: list[RequestOutput], step_time: float | None) -> None:
        """Tells on_step (metrics, trace, degradation) about a step; a failure there is logged
        with its traceback, never the engine's end."""
        if self.on_step is None:
            return
        try:
            self._report_step(outputs, step_time)
        except Exception:  # noqa: BLE001 - observers must not stop serving
            logger.exception("a step report failed; the engine serves on")

    def _report_step(self, outputs: list[RequestOutput], step_time: float | None) -> None:
        replicas = tuple(self.engine.load())
        self.on_step(StepInfo(
            outputs, step_time, sum(r.num_running for r in replicas),
            sum(r.num_waiting for r in replicas), sum(r.num_swapped for r in replicas),
            sum(r.used_blocks for r in replicas) / max(1, sum(r.usable_blocks for r in replicas)),
            self._outstanding_tokens(), replicas))

    def _dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine stopped on {type(self.error).__name__}: {self.error}"
        return "the engine is shut down" if self._stopped else "the engine is not started"

    def _fail_all(self) -> None:
        dead = EngineDeadError(self._dead_reason())
        self._deliver([(request_id, dead) for request_id in list(self._live)])
        self._live.clear()
        self._admitted.clear()
        while True:  # commands queued after the last drain
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(dead)


def _put_all(batch) -> None:
    for _, outputs, item in batch:
        outputs.put_nowait(item)
