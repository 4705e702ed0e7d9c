"""The engine core: an LLMEngine stepped in a process of its own, behind the server (vLLM V1's
shape). The server's process parses, tokenizes, renders and streams; this one admits, schedules
and steps, so the step's host work and the device step never wait on the server's event loop or
share its interpreter lock.

The channel is two ZeroMQ sockets over IPC, pickled messages, both bound by the server's side
(pagedjax.frontend.core_client) and connected from here:

    server -> core   ("add", call id, [PromptSpec], streamed)   admission + queueing, all or none
                     ("abort", request id)   ("limits", AdmissionLimits)
                     ("pause",)   ("resume",)   ("warmup",)   ("shutdown",)
    core -> server   ("ready", EngineDescription)  or  ("failed", ValueError or why)   once
                     ("reply", call id, request ids or the exception)
                     ("step", [delta-encoded outputs], StepInfo without its outputs)
                     ("aborted", request id)   ("dead", why)

One "step" message carries every output of a step, each as a delta (pagedjax.serving.
output_deltas). The core exits when told to, when its loop fails (after saying "dead"), or when
the server's process is gone (its parent changed).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import traceback
from typing import Any, Callable

from pagedjax.engine.memory_budget import describe_held
from pagedjax.frontend.admission_control import AdmissionLimits
from pagedjax.frontend.engine_control import run_control
from pagedjax.frontend.engine_driver import EngineDriver
from pagedjax.frontend.output_deltas import DeltaEncoder
from pagedjax.scheduler import RequestOutputKind

logger = logging.getLogger("pagedjax.engine_core")

IDLE_POLL_MS = 50  # how long an idle core waits for a message before checking its parent


@dataclasses.dataclass(frozen=True)
class EngineDescription:
    """What the server's process needs of the engine it does not hold."""

    config: Any  # EngineConfig
    model_config: Any
    tokenizer: Any
    stats: Any  # EngineStats at the start
    pid: int
    notes: tuple[str, ...] = ()  # lines for the server's log (the memory budget, warmup)
    held_memory: tuple[int, int] = (0, 0)  # (weights, KV pool) bytes: LLMEngine.held_memory
    runner_type: str = "generate"  # what the server serves (LLMEngine.runner_type)
    pooling_model: Any = None  # its pooler and head (pagedjax.pooling.pooling_model)


@dataclasses.dataclass(frozen=True)
class LLMFactory:
    """Builds the core's engine the way `pagedjax serve` does: LLM(model, tokenizer,
    **engine_kwargs).engine, compiled first with warmup."""

    model: Any
    tokenizer: Any = None
    engine_kwargs: dict = dataclasses.field(default_factory=dict)
    warmup: bool = False

    def __call__(self):
        import time

        from pagedjax.frontend.llm import LLM

        engine = LLM(self.model, tokenizer=self.tokenizer, **self.engine_kwargs).engine
        notes = [describe_held(engine)]
        if engine.memory_budget is not None:
            notes.append(engine.memory_budget.describe())
        if self.warmup:
            start = time.perf_counter()
            num_programs = engine.warmup(progress=False)
            notes.append(f"warmup: {num_programs} step programs ready in "
                         f"{time.perf_counter() - start:.1f} s (compilation cache: "
                         f"{engine.compilation_cache_dir or 'off'})")
        return engine, notes


def run(factory: Callable, input_address: str, output_address: str,
        limits: AdmissionLimits, parent_pid: int) -> None:
    """The core process's main: builds the engine with factory() (-> (engine, notes)), says
    ready, and serves the channel until told to stop. Ctrl-C reaches the whole process group:
    the core leaves it to the server, which stops it after the requests in flight."""
    import signal

    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)

    context = zmq.Context()
    inbox, outbox = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(input_address)
    outbox.connect(output_address)
    outbox.setsockopt(zmq.LINGER, 5000)
    try:
        try:
            engine, notes = factory()
        except BaseException as error:  # noqa: BLE001 - told to the server, which exits
            # a bad model or setting (ValueError) is the user's: its message; else the trace
            outbox.send_pyobj(("failed", error if isinstance(error, ValueError) else
                               f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
            return
        outbox.send_pyobj(("ready", EngineDescription(
            engine.config, engine.model_config, engine.tokenizer, engine.stats,
            os.getpid(), tuple(notes), engine.held_memory,
            engine.runner_type, engine.pooling_model)))
        try:
            _Core(engine, limits, inbox, outbox, parent_pid).serve()
        except BaseException as error:  # noqa: BLE001 - the core is dead; say why
            logger.exception("the engine core stopped")
            outbox.send_pyobj(("dead", f"{type(error).__name__}: {error}"))
        finally:
            engine.close()
    finally:
        inbox.close(0)
        outbox.close()
        context.term()


class _Core:
    def __init__(self, engine, limits: AdmissionLimits, inbox, outbox, parent_pid: int):
        self.driver = EngineDriver(engine, limits)
        self.engine = engine
        self.inbox, self.outbox = inbox, outbox
        self.parent_pid = parent_pid
        self.encoder = DeltaEncoder()
        self.paused = self.stopped = False

    def serve(self) -> None:
        import zmq

        idle_reported = False
        while not self.stopped:
            busy = not self.paused and self.driver.has_work()
            changed = False
            if busy or self.inbox.poll(IDLE_POLL_MS, zmq.POLLIN):
                changed = self._drain()
            if os.getppid() != self.parent_pid:
                return  # the server's process is gone: nobody to serve
            if self.stopped:
                return
            if self.paused or not self.driver.has_work():
                if changed or not idle_reported:  # gauges follow aborts and idleness
                    self._send_step([], None)
                    idle_reported = True
                continue
            idle_reported = False
            outputs, step_time = self.driver.step()
            self._send_step(outputs, step_time)

    def _send_step(self, outputs, step_time) -> None:
        info = self.driver.report([], step_time)
        self.outbox.send_pyobj(("step", [self.encoder.encode(out) for out in outputs], info))

    def _drain(self) -> bool:
        """Handles every message waiting; True when one was handled."""
        import zmq

        handled = False
        while True:
            try:
                message = self.inbox.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return handled
            handled = True
            self._handle(message)

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "add":
            _, call_id, prompts, streamed = message
            reply: object
            try:
                reply = self.driver.add(prompts, streamed)
                for spec, request_id in zip(prompts, reply):
                    if spec.params.output_kind == RequestOutputKind.DELTA:
                        self.encoder.expect_deltas(request_id)
            except Exception as error:  # noqa: BLE001 - the caller's: a 400 or a 429
                reply = error
            self.outbox.send_pyobj(("reply", call_id, reply))
        elif kind == "abort":
            if self.driver.abort(message[1]):
                self.encoder.forget(message[1])
                self.outbox.send_pyobj(("aborted", message[1]))
        elif kind == "control":  # a training-to-serving control (engine_control)
            _, call_id, name, kwargs = message
            try:
                reply = run_control(self.engine, name, kwargs)
            except Exception as error:  # noqa: BLE001 - the caller's: a 400
                reply = error
            self.outbox.send_pyobj(("control_reply", call_id, reply))
        elif kind == "limits":
            self.driver.limits = message[1]
        elif kind == "pause":
            self.paused = True
        elif kind == "resume":
            self.paused = False
        elif kind == "warmup":
            threading.Thread(target=report_warmup, daemon=True,
                             args=(self.engine.start_warmup(progress=False),)).start()
        elif kind == "shutdown":
            self.stopped = True
        else:
            raise ValueError(f"unknown engine core message {kind!r}")


def report_warmup(warmup) -> None:
    """Waits for a background warmup (runner.BackgroundWarmup) and says how it ended."""
    warmup.wait()
    if warmup.error is not None:
        print(f"warmup stopped ({warmup.error!r}); the rest compile on first use", flush=True)
    else:
        print(f"warmup: {warmup.num_programs} step programs ready in the background in "
              f"{warmup.seconds:.1f} s", flush=True)
