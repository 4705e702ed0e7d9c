"""What the engine does when a step fails: the failing request fails alone, a lost KV cache is
recomputed, and a failure beyond that fails every request and starts the engine over."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from pagedjax.engine.outputs import EngineOutput
from pagedjax.scheduler import Request

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine

logger = logging.getLogger("pagedjax.engine")

MAX_OOM_RETRIES = 2  # device OOMs a request may be recomputed after before it fails


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"[:500]


def is_device_oom(error: BaseException) -> bool:
    """Whether error is the device running out of memory (XLA's RESOURCE_EXHAUSTED)."""
    text = str(error)
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or \
        "out of memory" in text.lower()


class StepRecovery:
    """LLMEngine's failure handling, a part of the engine (engine.recovery): it keeps no state
    of its own and acts through the engine's step methods (outputs, fail_request,
    dispatch, start_over)."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def fail_all(self, error: BaseException) -> list[EngineOutput]:
        """After a step failed beyond one request's part (the KV cache lost with it): every
        unfinished request fails with the error, and the engine starts over with a fresh cache
        and an empty prefix cache, ready for new requests."""
        engine = self.engine
        if engine.async_scheduling is not None:
            engine.async_scheduling.abandon()
        message, now = describe(error), engine.clock()
        failed = list(engine.requests)
        for parent_id in failed:
            engine.fail_request(parent_id, message, now)
        outputs = [engine.outputs.request_output(parent_id, message) for parent_id in failed]
        engine.start_over()
        return outputs

    def recover(self, output, error: Exception) -> list[EngineOutput]:
        """A step raised before any result: each of its sequences runs again alone (its blocks
        are still allocated); the requests that fail alone too are dropped with their error,
        the others get their tokens, and the engine goes on. A step that lost the KV cache (a
        donated buffer was consumed) to a device OOM has every running request recomputed in a
        fresh cache (recompute_running); any other loss is raised: nothing can be retried."""
        engine = self.engine
        oom = is_device_oom(error)
        if oom:
            engine.stats.num_oom += 1
        if engine.runner.kv_cache_lost:
            if oom:
                return self.recompute_running(output, error)
            raise error
        outputs: list[EngineOutput] = []
        copies = output.copies
        advanced: list[Request] = []
        for seq in output.scheduled:
            if seq.request.status.finished:  # since it was scheduled (async scheduling)
                continue
            alone = dataclasses.replace(
                output, scheduled=[seq], forks=[f for f in output.forks if f[0] is seq.request],
                copies=copies, num_scheduled_tokens=seq.num_new_tokens, swap_out=[], swap_in=[])
            try:
                if len(output.scheduled) == 1:
                    raise error
                results = engine.runner.fetch(engine.dispatch(alone))
            except Exception as row_error:  # noqa: BLE001 - this request fails alone
                if engine.runner.kv_cache_lost:
                    raise
                parent_id = seq.request.parent_id
                if parent_id in engine.requests:
                    message = describe(row_error)
                    engine.fail_request(parent_id, message, engine.clock())
                    outputs.append(engine.outputs.request_output(parent_id, message))
                continue
            copies = []  # done once, by the first sequence that ran
            if not seq.request.status.finished:
                outputs.extend(engine.outputs.process(alone, results, advanced))
        engine.outputs.record(output, advanced)
        return outputs

    def recompute_running(self, output, error: Exception) -> list[EngineOutput]:
        """The KV cache is lost (a device OOM consumed it, or a step failed on the device with
        another step dispatched after it: async scheduling): a fresh cache, the prefix cache
        forgotten, and every running request back at the head of the queue to recompute its KV.
        The failed step's requests count a retry each; one past MAX_OOM_RETRIES fails, alone."""
        engine = self.engine
        oom = is_device_oom(error)
        logger.warning("%s lost the KV cache; recomputing the running requests: %s",
                       "device OOM" if oom else "a failed device step", describe(error))
        engine.runner.reset_kv_cache()
        scheduler = engine.scheduler
        state = scheduler.state
        for request in reversed(list(state.running)):  # requeued to the head, in order
            request.num_preemptions += 1  # preempted by recompute, as far as it can tell
            state.num_preemptions += 1
            scheduler.requeue(request)
        scheduler.kv_manager.drop_cached_content()
        outputs: list[EngineOutput] = []
        now = engine.clock()
        for parent_id in dict.fromkeys(s.request.parent_id for s in output.scheduled):
            entry = engine.requests.get(parent_id)
            if entry is None:
                continue
            entry.oom_retries += 1
            if entry.oom_retries > MAX_OOM_RETRIES:
                what = "out of device memory" if oom else "failed on the device"
                message = f"{what} {entry.oom_retries} times: {describe(error)}"
                engine.fail_request(parent_id, message, now)
                outputs.append(engine.outputs.request_output(parent_id, message))
        return outputs
