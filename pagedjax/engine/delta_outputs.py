"""DELTA outputs (SamplingParams.output_kind, vLLM's): each of a request's outputs holds only what
is new since its last one, built in O(new) from what the request's state says was sent, so a
streamed request of L tokens costs O(L) host work in all rather than O(L^2); and
CumulativeOutput, which merges a request's DELTA outputs back into the output a CUMULATIVE
request would end with (a non-streamed server answer).

A request with best_of > n is the exception: which n samples it returns is known only at the
end, so its DELTA outputs are one, once it finishes, holding those n whole (as FINAL_ONLY)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedjax.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedjax.scheduler import Request, RequestOutputKind

if TYPE_CHECKING:
    from pagedjax.engine.request_table import RequestState

__all__ = ["CumulativeOutput", "delta_output", "only_when_finished"]


def only_when_finished(samples: list[Request]) -> bool:
    """Whether a request's one output comes when it finishes (FINAL_ONLY; DELTA with best_of >
    n), not after each of its tokens."""
    params = samples[0].sampling_params
    return params.output_kind == RequestOutputKind.FINAL_ONLY or (
        params.output_kind == RequestOutputKind.DELTA and len(samples) > params.n)


def delta_output(state: RequestState, with_text: bool, **fields) -> RequestOutput:
    """state's output holding what is new since its last one (each sample's new tokens, their
    logprobs and text, the prompt logprobs computed since), and recorded as sent; fields: the
    rest of RequestOutput's (prompt, error, weight_version, lora_request)."""
    samples = state.samples
    leader = samples[0]
    finished = all(s.status.finished for s in samples)
    outputs = [_new_part(state, i, s, with_text) for i, s in enumerate(samples)]
    prompt_logprobs = None
    if leader.sampling_params.prompt_logprobs is not None:
        prompt_logprobs = leader.prompt_logprobs[state.prompt_logprobs_sent:]
        state.prompt_logprobs_sent = len(leader.prompt_logprobs)
    return RequestOutput(request_id=leader.parent_id, prompt_token_ids=leader.prompt_token_ids,
                         outputs=outputs, finished=finished,
                         metrics=RequestMetrics.of(samples, finished),
                         cache_salt=leader.cache_salt, prompt_logprobs=prompt_logprobs, **fields)


def _new_part(state: RequestState, index: int, sample: Request,
              with_text: bool) -> CompletionOutput:
    sent = state.sent.setdefault(sample.request_id, [0, 0])  # [tokens, characters]
    tokens = sample.output_token_ids
    start = min(sent[0], len(tokens))
    text = None
    finished = sample.status.finished
    if with_text:
        text_state = state.texts[sample.request_id]
        end = text_state.visible_length(finished)
        text = text_state.slice(sent[1], end) if end > sent[1] else ""  # it never shrinks
        sent[1] = max(sent[1], end)
    sent[0] = len(tokens)
    return CompletionOutput(
        index=index, token_ids=tokens[start:],
        finish_reason=sample.status.value if finished else None,
        cumulative_logprob=sample.cumulative_logprob,
        logprobs=(sample.logprobs[start:] if sample.sampling_params.logprobs is not None
                  else None),
        text=text, stop_reason=sample.stop_reason if finished else None,
        num_tokens=len(tokens))


class CumulativeOutput:
    """One request's DELTA outputs merged, O(new) each, into the output a CUMULATIVE request
    would have (built by output(), once)."""

    def __init__(self) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.texts: dict[int, list[str]] = {}
        self.prompt_logprobs: list | None = None
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        for choice in out.outputs:
            i = choice.index
            self.tokens.setdefault(i, []).extend(choice.token_ids)
            if choice.logprobs is not None:
                self.logprobs.setdefault(i, []).extend(choice.logprobs)
            if choice.text is not None:
                self.texts.setdefault(i, []).append(choice.text)
        if out.prompt_logprobs is not None:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(out.prompt_logprobs)
        self.last = out

    def output(self) -> RequestOutput:
        last = self.last
        if last is None:
            raise ValueError("CumulativeOutput.output() before any output was added")
        outputs = [CompletionOutput(
            index=c.index, token_ids=list(self.tokens[c.index]), finish_reason=c.finish_reason,
            cumulative_logprob=c.cumulative_logprob,
            logprobs=None if c.logprobs is None else list(self.logprobs[c.index]),
            text="".join(self.texts[c.index]) if c.index in self.texts else None,
            stop_reason=c.stop_reason) for c in last.outputs]
        return RequestOutput(
            request_id=last.request_id, prompt_token_ids=list(last.prompt_token_ids),
            outputs=outputs, finished=last.finished, metrics=last.metrics, prompt=last.prompt,
            error=last.error, cache_salt=last.cache_salt, prompt_logprobs=self.prompt_logprobs,
            weight_version=last.weight_version, lora_request=last.lora_request)
