"""What the engine does when a step fails: the failing request fails alone, a lost KV cache is
recomputed, and a failure beyond that fails every request and starts the engine over."""

from __future__ import annotations

import dataclasses
import logging

from pagedjax.engine.outputs import RequestOutput
from pagedjax.scheduler import RequestStatus

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
    """LLMEngine's failure handling (a mixin: it works on the engine's scheduler, runner,
    request groups and stats)."""

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        """After a step failed beyond one request's part (the KV cache lost with it): every
        unfinished request fails with the error, and the engine starts over with a fresh cache
        and an empty prefix cache, ready for new requests."""
        if self.async_scheduling is not None:
            self.async_scheduling.abandon()
        message, now = describe(error), self.clock()
        failed = list(self.requests)
        for parent_id in failed:
            self._fail(parent_id, message, now)
        outputs = [self._output(parent_id, message) for parent_id in failed]
        if self.kv_tiers is not None:
            self.kv_tiers.start_over(self.scheduler.kv_manager)
        self.scheduler = self._make_scheduler()
        self.token_masks.clear()
        if self.runner.kv_cache_lost:
            self.runner.reset_kv_cache()
        return outputs

    def _fail(self, parent_id: str, message: str, now: float) -> None:
        for sample in self.requests[parent_id].samples:
            if not sample.status.finished:
                self.scheduler.abort(sample.request_id, now, RequestStatus.FINISHED_ERROR)
        self.stats.num_failed += 1

    def _recover(self, output, error: Exception) -> list[RequestOutput]:
        """A step raised before any result: each of its sequences runs again alone (its blocks
        are still allocated); the requests that fail alone too are dropped with their error,
        the others get their tokens, and the engine goes on. A step that lost the KV cache (a
        donated buffer was consumed) to a device OOM has every running request recomputed in a
        fresh cache (recompute_running); any other loss is raised: nothing can be retried."""
        oom = is_device_oom(error)
        if oom:
            self.stats.num_oom += 1
        if self.runner.kv_cache_lost:
            if oom:
                return self.recompute_running(output, error)
            raise error
        outputs, copies, advanced = [], output.copies, []
        for seq in output.scheduled:
            if seq.request.status.finished:  # since it was scheduled (async scheduling)
                continue
            alone = dataclasses.replace(
                output, scheduled=[seq], forks=[f for f in output.forks if f[0] is seq.request],
                copies=copies, num_scheduled_tokens=seq.num_new_tokens, swap_out=[], swap_in=[])
            try:
                if len(output.scheduled) == 1:
                    raise error
                results = self.runner.fetch(self._dispatch(alone))
            except Exception as row_error:  # noqa: BLE001 - this request fails alone
                if self.runner.kv_cache_lost:
                    raise
                parent_id = seq.request.parent_id
                if parent_id in self.requests:
                    message = describe(row_error)
                    self._fail(parent_id, message, self.clock())
                    outputs.append(self._output(parent_id, message))
                continue
            copies = []  # done once, by the first sequence that ran
            if not seq.request.status.finished:
                outputs.extend(self._postprocess(alone, results, advanced))
        self._record(output, advanced)
        return outputs

    def recompute_running(self, output, error: Exception) -> list[RequestOutput]:
        """The KV cache is lost (a device OOM consumed it, or a step failed on the device with
        another step dispatched after it: async scheduling): a fresh cache, the prefix cache
        forgotten, and every running request back at the head of the queue to recompute its KV.
        The failed step's requests count a retry each; one past MAX_OOM_RETRIES fails, alone."""
        oom = is_device_oom(error)
        logger.warning("%s lost the KV cache; recomputing the running requests: %s",
                       "device OOM" if oom else "a failed device step", describe(error))
        self.runner.reset_kv_cache()
        state = self.scheduler.state
        for request in reversed(list(state.running)):  # requeued to the head, in order
            request.num_preemptions += 1  # preempted by recompute, as far as it can tell
            state.num_preemptions += 1
            self.scheduler.requeue(request)
        self.scheduler.kv_manager.drop_cached_content()
        outputs, now = [], self.clock()
        for parent_id in dict.fromkeys(s.request.parent_id for s in output.scheduled):
            state = self.requests.get(parent_id)
            if state is None:
                continue
            state.oom_retries += 1
            retries = state.oom_retries
            if retries > MAX_OOM_RETRIES:
                what = "out of device memory" if oom else "failed on the device"
                message = f"{what} {retries} times: {describe(error)}"
                self._fail(parent_id, message, now)
                outputs.append(self._output(parent_id, message))
        return outputs
