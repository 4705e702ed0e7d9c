"""A finished step's results turned into the engine's outputs (a part of LLMEngine,
engine.outputs): the scheduler advanced by the sampled tokens, each new token's grammar, stop
strings and logprob texts, the pooled states fed to their pools, each advanced request's output,
and the step's counters. A request whose part fails (its detokenization) fails alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedjax.engine import prompt_logprobs
from pagedjax.engine.delta_outputs import delta_output, only_when_finished
from pagedjax.engine.kv_snapshot import UsageSample, tokens_stored
from pagedjax.engine.outputs import EngineOutput, RequestOutput
from pagedjax.engine.step_recovery import describe
from pagedjax.engine.step_results import StepResults
from pagedjax.scheduler import DECODE, Request, RequestOutputKind, RequestStatus

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine


class StepOutputs:
    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def process(self, output, results: StepResults, advanced: list[Request],
                final_only: bool = False) -> list[EngineOutput]:
        """Advances the step's requests by its results (appending them to advanced); one
        output per request that got a token (final_only: per request that finished). A request
        whose detokenization fails is dropped alone."""
        engine = self.engine
        now = engine.clock()
        prompt_logprobs.record(output, results.prompt, engine.tokenizer)
        engine.pooling.record(output, results.pooled)
        failed: dict[str, str] = {}
        new = engine.scheduler.update(output, results.sampled_ids, now, results.logprobs,
                                      results.top_ids, results.top_logprobs, results.ranks,
                                      lambda sample: self._on_token(sample, failed))
        advanced.extend(new)
        for parent_id, message in failed.items():
            engine.fail_request(parent_id, message, now)
        parents = list(dict.fromkeys(r.parent_id for r in new))
        requests = engine.requests
        parents = [p for p in parents if requests[p].finished or not (
            final_only or only_when_finished(requests[p].samples))]
        return [self.request_output(parent_id, failed.get(parent_id)) for parent_id in parents]

    def _on_token(self, sample: Request, failed: dict[str, str]) -> RequestStatus | None:
        """After each token the scheduler appends: a grammar complete or a stop string ends the
        sample (FINISHED_STOPPED), a failing detokenization fails it alone (recorded in failed),
        and the token's logprobs get their texts. (A pooling request's token is nobody's.)"""
        if sample.pooling is not None:
            return None
        engine = self.engine
        engine.stats.num_generated_tokens += 1
        tokenizer = engine.tokenizer
        try:
            stopped = engine.token_masks.advance(sample)  # a grammar complete
            if tokenizer is not None:
                stopped = engine.requests.sample_text(sample).advance(sample) or stopped
                if len(sample.logprobs) == sample.num_output_tokens:  # this token's entry
                    for token_id, logprob in sample.logprobs[-1].items():
                        logprob.decoded_token = tokenizer.decode(
                            [token_id], skip_special_tokens=False)
        except Exception as error:  # noqa: BLE001 - this request fails alone
            failed[sample.parent_id] = describe(error)
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if stopped else None

    def request_output(self, parent_id: str,
                       error: str | None = None) -> EngineOutput:
        """parent_id's output now; a finished request leaves the table (RequestTable.finish)."""
        engine = self.engine
        state = engine.requests[parent_id]
        out: EngineOutput
        if state.pooling is not None:
            out = engine.pooling.output(state, error)
        else:
            samples = state.samples
            lora_id = samples[0].lora_id
            fields: dict[str, Any] = dict(
                prompt=state.prompt_text, error=error,
                weight_version=state.record_version(engine.weights.weight_version),
                lora_request=(None if lora_id is None else
                              engine.loras.manager().adapters[lora_id]))
            params = samples[0].sampling_params
            if params.output_kind == RequestOutputKind.DELTA and len(samples) == params.n:
                out = delta_output(state, engine.tokenizer is not None, **fields)
            else:
                texts = None
                if engine.tokenizer is not None:
                    texts = {s.request_id: state.texts[s.request_id].visible_text(
                        s.status.finished) for s in samples}
                out = RequestOutput.from_samples(samples, params.n, texts, **fields)
        if out.finished:
            engine.requests.finish(parent_id)
        return out

    def record(self, output, advanced: list[Request]) -> None:
        """The step's counters (EngineStats), the usage history, the peak of the pool."""
        engine = self.engine
        state, stats = engine.scheduler.state, engine.stats
        stats.record_step(output.kind == DECODE, output.num_scheduled_tokens, advanced, state,
                          sum(max(0, min(s.start + s.num_new_tokens,
                                         s.request.num_prompt_tokens) - s.start)
                              for s in output.scheduled))
        if engine.kv_tiers is not None:
            stats.kv_tiers = engine.kv_tiers.counters(state.kv_manager)
        if engine.lora_manager is not None:
            stats.loras = engine.lora_manager.stats(state)
        used_blocks = state.kv_manager.num_used_blocks
        engine.usage_history.append(UsageSample(stats.num_steps, engine.clock(), used_blocks,
                                                len(state.running), len(state.waiting)))
        if used_blocks > stats.peak_used_blocks:  # rare once warm: tokens_stored is O(blocks)
            stats.peak_used_blocks = used_blocks
            stats.peak_used_tokens = tokens_stored(engine.scheduler)
