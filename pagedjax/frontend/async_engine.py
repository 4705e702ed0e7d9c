"""AsyncLLMEngine: one LLMEngine stepped on its own thread, driven from asyncio (the server).

The LLMEngine is not thread-safe, so only the engine thread touches it: adds, aborts and
inspections are closures queued to that thread and run between steps; outputs go back to each
request's asyncio queue through its event loop. A step blocks in JAX for milliseconds to seconds;
the event loop keeps accepting and streaming meanwhile.

Admission control (pagedjax.frontend.admission_control) runs on the engine thread against the
live requests: a refused request gets OverloadedError at once (the server's HTTP 429, with its
reason) instead of queueing behind minutes of work.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from typing import TYPE_CHECKING, Callable, Sequence

from pagedjax.engine.llm_engine import LLMEngine
from pagedjax.engine.outputs import EngineOutput, RequestOutput
from pagedjax.engine.request_checks import PromptSpec
from pagedjax.frontend.admission_control import AdmissionLimits, OverloadedError
from pagedjax.frontend.engine_client import EngineClient
from pagedjax.frontend.engine_control import run_control
from pagedjax.frontend.engine_driver import EngineDriver, StepInfo

if TYPE_CHECKING:
    from pagedjax.frontend.core_client import CoreClient

logger = logging.getLogger("pagedjax.engine")

__all__ = ["AsyncLLMEngine", "EngineDeadError", "OverloadedError", "PromptSpec",
           "RequestFailedError", "RequestGroup", "StepInfo"]


class RequestFailedError(RuntimeError):
    """A request failed inside a step and was dropped alone (the engine serves the others)."""


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error or was shut down; no request can be served."""


class RequestGroup:
    """The outputs of requests added together, in the order the engine produced them; iterate
    until every request has finished. Leaving early (`async with` / `aclose`, e.g. a client that
    went away) aborts the unfinished ones and frees their blocks."""

    def __init__(self, engine: "AsyncLLMEngine | CoreClient", request_ids: list[str],
                 outputs: asyncio.Queue):
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


class AsyncLLMEngine(EngineClient):
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
        self.driver = EngineDriver(engine, limits)
        self.on_step = on_step
        self.on_abort = on_abort
        self.idle_wait_s = idle_wait_s
        self.error: BaseException | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._paused = False
        # Engine-thread state: request id -> the loop and queue its outputs go to.
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)

    @property
    def limits(self) -> AdmissionLimits:
        return self.driver.limits

    @limits.setter
    def limits(self, limits: AdmissionLimits) -> None:
        self.driver.limits = limits

    @property
    def num_live(self) -> int:
        """Requests admitted and not finished (nor aborted)."""
        return len(self.driver.admitted)

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
            raise EngineDeadError(self.dead_reason())
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def control(self, name: str, **kwargs):
        """A training-to-serving control (pagedjax.frontend.engine_control) on the engine
        thread between steps; its result, or its exception."""
        return await self.call(lambda engine: run_control(engine, name, kwargs))

    async def add_requests(self, prompts: Sequence[PromptSpec],
                           streamed: bool = True) -> "RequestGroup":
        """Queues several requests at once, all or none: each is validated (ValueError naming
        the field) and admission control checks them together (OverloadedError) before any is
        queued; streamed: whether their client streams (the non-streamed cap counts the
        others). Their outputs arrive, interleaved, through the returned group."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def add(engine: LLMEngine) -> list[str]:
            ids = self.driver.add(prompts, streamed)
            for request_id in ids:
                self._sinks[request_id] = (loop, outputs)
            return ids

        return RequestGroup(self, await self.call(add), outputs)

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
        self._sinks.pop(request_id, None)
        if self.driver.abort(request_id) and self.on_abort is not None:
            self.on_abort(request_id)

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
        """Hands (request id, output or error) pairs to their callers (hand_over); a request
        whose caller's loop is closed is aborted."""
        gone = hand_over([(request_id, self._sinks[request_id], item)
                          for request_id, item in items])
        for request_id in gone:
            self._abort(request_id)

    def _run(self) -> None:
        try:
            idle_reported = False
            while not self._stopped:
                changed = self._drain()
                if self._paused or not self.driver.has_work():
                    if changed or not idle_reported:  # gauges follow aborts and idleness
                        self._report([], None)
                        idle_reported = True
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
                    continue
                idle_reported = False
                outputs, step_time = self.driver.step()
                self._report(outputs, step_time)  # first: a caller who has its output
                # finds it in the metrics and the trace
                self._deliver([(out.request_id, as_delivered(out)) for out in outputs])
                for out in outputs:
                    if out.finished:
                        self._sinks.pop(out.request_id, None)
        except BaseException as e:  # noqa: BLE001 - the engine is dead; tell every caller
            self.error = e
        finally:
            self._fail_all()

    def _report(self, outputs: list[EngineOutput], step_time: float | None) -> None:
        """Tells on_step (metrics, trace, degradation) about a step; a failure there is logged
        with its traceback, never the engine's end."""
        if self.on_step is None:
            return
        try:
            self.on_step(self.driver.report(outputs, step_time))
        except Exception:  # noqa: BLE001 - observers must not stop serving
            logger.exception("a step report failed; the engine serves on")

    def dead_reason(self) -> str:
        if self.error is not None:
            return f"the engine stopped on {type(self.error).__name__}: {self.error}"
        return "the engine is shut down" if self._stopped else "the engine is not started"

    def _fail_all(self) -> None:
        dead = EngineDeadError(self.dead_reason())
        self._deliver([(request_id, dead) for request_id in self.driver.drop_all()])
        self._sinks.clear()
        while True:  # commands queued after the last drain
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future is not None and future.set_running_or_notify_cancel():
                future.set_exception(dead)


def as_delivered(out: EngineOutput) -> EngineOutput | RequestFailedError:
    """What a request's caller receives for an output: the output, or the error of a request
    that failed inside a step."""
    if out.error is None:
        return out
    return RequestFailedError(f"request {out.request_id} failed inside a step and was "
                              f"dropped: {out.error}")


def hand_over(items) -> list[str]:
    """Hands (request id, (loop, queue), output or error) triples to their callers' event
    loops from another thread: one wakeup per loop, not one per output. Returns the ids whose
    loop is closed (nobody is listening)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for request_id, (loop, outputs), item in items:
        by_loop.setdefault(loop, []).append((request_id, outputs, item))
    gone = []
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, batch)
        except RuntimeError:  # the loop is closed
            gone += [request_id for request_id, _, _ in batch]
    return gone


def _put_all(batch) -> None:
    for _, outputs, item in batch:
        outputs.put_nowait(item)
