"""LLMEngine's request intake (a part of the engine): requests checked all or none
(request_checks), built into their samples with seeds and ids, queued with their token masks and
texts into the request table, and aborted."""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set as AbstractSet
from typing import TYPE_CHECKING

import numpy as np

from pagedjax.engine.output_processor import TextState
from pagedjax.engine.request_checks import Admission, PromptSpec, check_specs
from pagedjax.engine.request_table import PoolingState, RequestState
from pagedjax.scheduler import Request, SamplingParams, make_samples

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine


class RequestIntake:
    """LLMEngine's requests in (engine.intake): it owns the ids it hands out and the seeds it
    draws for requests that give none."""

    def __init__(self, engine: LLMEngine, seed_rng: np.random.Generator):
        self.engine = engine
        self._seed_rng = seed_rng
        self._next_id = 0

    def add_requests(self, specs: Sequence[PromptSpec],
                     admit: Callable[[list[Admission]], None] | None = None) -> list[str]:
        """Queues several requests all or none and returns their ids: each is checked against
        the engine's limits (admission.check_specs) before anything is built; admit, when given,
        sees the checked requests next and may refuse them all by raising. On any error nothing
        is built or queued. A sleeping engine refuses them (SleepMode.check_awake)."""
        self.engine.sleep_mode.check_awake()
        admissions = check_specs(self.engine, specs)
        if admit is not None:
            admit(admissions)
        return self.queue_admitted(admissions)

    def queue_admitted(self, admissions: Sequence[Admission]) -> list[str]:
        """Builds and queues requests check_specs passed (and returns their ids)."""
        taken = {a.request_id for a in admissions}
        requests = [self._build(a, taken) for a in admissions]
        for request, admission in zip(requests, admissions):
            pooling = None
            if admission.spec.pooling_params is not None:
                pooling = self.engine.pooling.start(request, admission.spec.pooling_params)
            self.queue(request, admission.constraints or False, pooling)
            self.engine.requests[request.parent_id].prompt_text = admission.spec.prompt_text
        return [r.parent_id for r in requests]

    def add_request(self, prompt_token_ids: Sequence[int],
                    sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    cache_salt: str | None = None, lora_request=None) -> str:
        """Queues a request and returns its id; on bad input raises RequestError (a ValueError
        naming the field) and queues nothing.

        Requests share prefix-cached blocks only when their cache_salt is equal (None included).
        lora_request: the LoRA adapter it runs under (a pagedjax.LoRARequest; None: the base
        model).
        """
        spec = PromptSpec(prompt_token_ids, sampling_params or SamplingParams(), request_id,
                          cache_salt=cache_salt, arrival_time=arrival_time,
                          lora_request=lora_request)
        return self.add_requests([spec])[0]

    def make_request(self, prompt_token_ids: Sequence[int], sampling_params: SamplingParams,
                     request_id: str | None = None, arrival_time: float | None = None,
                     cache_salt: str | None = None) -> Request:
        """A checked request with its samples, not queued (benchmarks drive it by hand)."""
        spec = PromptSpec(prompt_token_ids, sampling_params, request_id, cache_salt=cache_salt,
                          arrival_time=arrival_time)
        return self._build(check_specs(self.engine, [spec])[0])

    def _build(self, admission: Admission,
               taken: AbstractSet[str | None] = frozenset()) -> Request:
        spec = admission.spec
        seed = spec.params.seed
        if seed is None:
            seed = int(self._seed_rng.integers(0, 2**32))
        request_id = admission.request_id
        if request_id is None:
            request_id = str(self._next_id)
            while request_id in self.engine.requests or request_id in taken:
                self._next_id += 1
                request_id = str(self._next_id)
            self._next_id += 1
        arrival_time = self.engine.clock() if spec.arrival_time is None else spec.arrival_time
        lora_id, lora_key = admission.lora or (None, None)
        return make_samples(request_id, admission.prompt_token_ids, spec.params, seed=seed,
                            arrival_time=arrival_time, cache_salt=spec.cache_salt,
                            eos_token_ids=self.engine.model_config.eos_token_ids,
                            lora_id=lora_id, lora_key=lora_key)

    def queue(self, request: Request, constraints=None,
              pooling: PoolingState | None = None) -> None:
        """Queues a request from make_request (with its parallel samples). constraints: its
        token_masks.Constraints from admission (False: it has none; None: built here);
        pooling: its pool (PoolingRequests.start), when it pools."""
        engine = self.engine
        if constraints is None:
            constraints = engine.token_masks.constraints(request.sampling_params)
        engine.scheduler.add_request(request)
        samples = [request, *request.followers]
        engine.token_masks.add(samples, constraints or None)
        state = RequestState(request.parent_id, samples, pooling=pooling)
        if engine.tokenizer is not None and pooling is None:
            state.texts = {s.request_id: TextState(engine.tokenizer, s) for s in samples}
        engine.requests.add(state)

    def set_prompt_text(self, request_id: str, prompt: str) -> None:
        """Records the text a queued request's prompt came from (returned in its outputs)."""
        if request_id in self.engine.requests:
            self.engine.requests[request_id].prompt_text = prompt

    def abort(self, request_id: str) -> None:
        """Finishes a request (all its samples) at once and frees its blocks; unknown or
        finished ids are ignored."""
        engine = self.engine
        state = engine.requests.finish(request_id)
        if state is None:
            return
        now = engine.clock()
        for sample in state.samples:
            engine.scheduler.abort(sample.request_id, now)
        engine.stats.num_aborted += 1
