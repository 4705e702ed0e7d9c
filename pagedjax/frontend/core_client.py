"""The server's side of the engine core (pagedjax.frontend.engine_core): starts the core's
process, and serves the server exactly as AsyncLLMEngine does (add_requests, abort, limits,
pause, health), over the channel instead of a thread.

One reader thread takes the core's messages in order: a reply resolves its caller (its request
ids registered first, so no output can overtake them), a step's delta-encoded outputs are rebuilt
into the engine's cumulative RequestOutputs, reported to metrics, and handed to their callers'
event loops, one wakeup per loop. The core's process is watched: if it dies, every live request
fails with EngineDeadError at once (the server answers 503, /health too), and shutdown() stops it
(asked, then terminated, then killed) so no process outlives the server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from typing import Callable, Sequence

from pagedjax.engine.request_checks import PromptSpec
from pagedjax.frontend import engine_core
from pagedjax.frontend.admission_control import AdmissionLimits
from pagedjax.frontend.async_engine import EngineDeadError, RequestGroup, as_delivered, hand_over
from pagedjax.frontend.engine_client import EngineClient
from pagedjax.frontend.engine_driver import StepInfo
from pagedjax.frontend.output_deltas import DeltaDecoder

logger = logging.getLogger("pagedjax.engine_core")

READ_POLL_MS = 100  # the reader's wait for a message before it checks the core is alive


class EngineView:
    """The engine as the server's process sees it: its configuration, model configuration and
    tokenizer (the core's own, pickled over), its totals at the start, what it holds (weights,
    KV pool), and the clock its timestamps use (time.perf_counter: CLOCK_MONOTONIC, one clock for every process here)."""

    def __init__(self, description: engine_core.EngineDescription):
        self.config = description.config
        self.model_config = description.model_config
        self.tokenizer = description.tokenizer
        self.stats = description.stats
        self.held_memory = description.held_memory
        self.runner_type = description.runner_type
        self.pooling_model = description.pooling_model
        self.clock = time.perf_counter

    def close(self) -> None:
        """The core's process closes its engine when it stops."""


class CoreClient(EngineClient):
    def __init__(self, factory: Callable, *, limits: AdmissionLimits | None = None,
                 on_step: Callable[[StepInfo], None] | None = None,
                 on_abort: Callable[[str], None] | None = None,
                 startup_timeout_s: float = 600.0):
        """Starts the core's process (factory: a picklable callable building (engine, notes)
        there, engine_core.LLMFactory) and waits until its engine is built; if it fails, raises
        the ValueError that named a bad model or setting, else RuntimeError with the core's
        traceback."""
        import zmq

        self._limits = limits or AdmissionLimits()
        self.on_step = on_step
        self.on_abort = on_abort
        self.on_death: Callable[[str], None] | None = None  # the core died (not stopped)
        self.error: str | None = None
        self._stopped = False
        self._sinks: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # call id -> (its future, and for an add its caller's loop and queue)
        self._pending: dict[int, tuple[concurrent.futures.Future,
                                       asyncio.AbstractEventLoop | None, asyncio.Queue | None]] = {}
        self._call_ids = itertools.count()
        self._decoder = DeltaDecoder()
        self._send_lock = threading.Lock()
        self._dir = tempfile.mkdtemp(prefix="pagedjax-core-")
        self._context = zmq.Context()
        self._outbox = self._context.socket(zmq.PUSH)
        self._inbox = self._context.socket(zmq.PULL)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.bind(f"ipc://{self._dir}/in")
        self._inbox.bind(f"ipc://{self._dir}/out")
        spawn = multiprocessing.get_context("spawn")  # JAX is not fork-safe
        self.process = spawn.Process(
            target=engine_core.run, name="pagedjax-engine-core", daemon=True,
            args=(factory, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out", self._limits,
                  os.getpid()))
        self.process.start()
        try:
            description = self._wait_ready(startup_timeout_s)
        except BaseException:
            self._stop_process(0.0)
            self._close_channel()
            raise
        self.engine = EngineView(description)
        self.notes = description.notes
        self._reader = threading.Thread(target=self._read, name="pagedjax-core-reader",
                                        daemon=True)

    def _wait_ready(self, timeout_s: float) -> engine_core.EngineDescription:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._inbox.poll(READ_POLL_MS):
                kind, payload = self._inbox.recv_pyobj()
                if kind == "ready":
                    return payload
                if isinstance(payload, ValueError):  # a bad model or setting, named
                    raise payload
                raise RuntimeError(f"the engine core failed to start: {payload}")
            if not self.process.is_alive():
                raise RuntimeError(f"the engine core exited (code {self.process.exitcode}) "
                                   f"before it was ready")
        raise RuntimeError(f"the engine core was not ready within {timeout_s:g} s")

    # ---- AsyncLLMEngine's interface ----------------------------------------------------------

    @property
    def limits(self) -> AdmissionLimits:
        return self._limits

    @limits.setter
    def limits(self, limits: AdmissionLimits) -> None:
        self._limits = limits
        self._send(("limits", limits))

    @property
    def num_live(self) -> int:
        return len(self._sinks)

    def start(self) -> "CoreClient":
        self._reader.start()
        return self

    @property
    def running(self) -> bool:
        return self.process.is_alive()

    @property
    def healthy(self) -> bool:
        return (self.error is None and not self._stopped and self._reader.is_alive()
                and self.process.is_alive())

    def dead_reason(self) -> str:
        if self.error is not None:
            return self.error
        if self._stopped:
            return "the engine is shut down"
        if not self.process.is_alive():
            return f"the engine core exited (code {self.process.exitcode})"
        return "the engine is not started"

    def pause(self) -> None:
        self._send(("pause",))

    def resume(self) -> None:
        self._send(("resume",))

    def start_warmup(self) -> None:
        """Compiles every step program in the core's background (--warmup-background)."""
        self._send(("warmup",))

    async def add_requests(self, prompts: Sequence[PromptSpec],
                           streamed: bool = True) -> RequestGroup:
        """As AsyncLLMEngine.add_requests: validated and admitted by the core, all or none."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason())
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._pending[call_id] = (future, loop, outputs)
        self._send(("add", call_id, list(prompts), streamed))
        return RequestGroup(self, await asyncio.wrap_future(future), outputs)

    async def control(self, name: str, **kwargs):
        """As AsyncLLMEngine.control, run by the core between its steps."""
        if not self.healthy:
            raise EngineDeadError(self.dead_reason())
        future: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self._call_ids)
        self._pending[call_id] = (future, None, None)
        self._send(("control", call_id, name, kwargs))
        return await asyncio.wrap_future(future)

    async def abort(self, request_id: str) -> None:
        self.abort_soon(request_id)

    def abort_soon(self, request_id: str) -> None:
        """Aborts a request from any thread: its outputs stop at once, the core frees it
        before its next step."""
        if self._sinks.pop(request_id, None) is not None and self.healthy:
            self._send(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the core after its current step, and its process (terminated, then killed, if
        it does not exit in time); live requests end with EngineDeadError."""
        if not self._stopped:
            self._stopped = True
            if self.process.is_alive():
                self._send(("shutdown",))
        self._stop_process(timeout)
        if self._reader.is_alive():
            self._reader.join(timeout)
        self._fail_all()
        self._close_channel()

    # ---- the reader thread -------------------------------------------------------------------

    def _send(self, message: tuple) -> None:
        with self._send_lock:
            if not self._outbox.closed:
                self._outbox.send_pyobj(message)

    def _read(self) -> None:
        try:
            while True:
                if self._inbox.poll(READ_POLL_MS):
                    self._handle(self._inbox.recv_pyobj())
                    continue
                if not self.process.is_alive():
                    if self.error is None and not self._stopped:
                        self.error = (f"the engine core exited (code {self.process.exitcode})")
                    return
                if self._stopped:
                    return
        except BaseException as error:  # noqa: BLE001 - the channel is broken: nothing serves
            if not self._stopped:
                logger.exception("the engine core's channel failed")
                self.error = f"the engine core's channel failed: {error!r}"
        finally:
            self._fail_all()
            if not self._stopped and self.on_death is not None:
                self.on_death(self.dead_reason())

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "step":
            self._on_step(message[1], message[2])
        elif kind == "reply":
            pending = self._pending.pop(message[1], None)
            if pending is None:  # failed meanwhile (the core died)
                return
            future, loop, outputs = pending
            reply = message[2]
            if isinstance(reply, BaseException):
                future.set_exception(reply)
                return
            if loop is not None and outputs is not None:  # an add's
                for request_id in reply:
                    self._sinks[request_id] = (loop, outputs)
            future.set_result(reply)
        elif kind == "control_reply":
            pending = self._pending.pop(message[1], None)
            if pending is not None:
                reply = message[2]
                if isinstance(reply, BaseException):
                    pending[0].set_exception(reply)
                else:
                    pending[0].set_result(reply)
        elif kind == "aborted":
            self._decoder.forget(message[1])
            if self.on_abort is not None:
                self.on_abort(message[1])
        elif kind == "dead":
            self.error = f"the engine core stopped on {message[1]}"
            self._stop_process(5.0)

    def _on_step(self, wire: list, info: StepInfo) -> None:
        outputs = []
        for item in wire:  # the decoder is the reader's alone
            if item[0] in self._sinks:
                outputs.append(self._decoder.decode(item))
            else:  # aborted by its caller: what was sent of it is of no more use
                self._decoder.forget(item[0])
        info = dataclasses.replace(info, outputs=outputs)
        if self.on_step is not None:
            try:
                self.on_step(info)
            except Exception:  # noqa: BLE001 - observers must not stop serving
                logger.exception("a step report failed; the engine serves on")
        items = []
        for out in outputs:
            sink = (self._sinks.pop if out.finished else self._sinks.get)(out.request_id, None)
            if sink is not None:  # else aborted by its caller meanwhile (another thread)
                items.append((out.request_id, sink, as_delivered(out)))
        for request_id in hand_over(items):  # their callers' loops are closed
            self.abort_soon(request_id)

    def _fail_all(self) -> None:
        dead = EngineDeadError(self.dead_reason())
        for future, _, _ in list(self._pending.values()):
            if not future.done():
                future.set_exception(dead)
        self._pending.clear()
        sinks, self._sinks = self._sinks, {}
        hand_over([(request_id, sink, dead) for request_id, sink in list(sinks.items())])

    def _stop_process(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)

    def _close_channel(self) -> None:
        with self._send_lock:
            self._outbox.close(0)
        self._inbox.close(0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)
