"""Beam search over the engine: each step submits one-token requests for every live beam and
keeps the beam_width best continuations.

Beams of a prompt share all their full blocks through the prefix cache, so a step computes only
each beam's newest tokens (at most a block's worth), as vLLM's own beam search does.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pagedjax.engine.request_checks import PromptSpec, check_prompt_token_ids, check_specs
from pagedjax.scheduler import RequestError, SamplingParams
from pagedjax.scheduler.errors import check_bool, check_float, check_int
from pagedjax.scheduler.request import INT32_MAX


@dataclasses.dataclass(frozen=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0  # score = cumulative logprob / length ** length_penalty
    ignore_eos: bool = False

    def __post_init__(self):
        check_int("beam_width", self.beam_width, 1, INT32_MAX)
        check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        check_float("length_penalty", self.length_penalty, -1e3, 1e3)
        check_bool("ignore_eos", self.ignore_eos)


@dataclasses.dataclass(frozen=True)
class BeamSequence:
    token_ids: list[int]  # generated tokens
    cumulative_logprob: float
    finished: bool = False  # ended with EOS
    text: str | None = None  # the tokens detokenized, when the engine has a tokenizer

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / max(len(self.token_ids), 1) ** length_penalty


def beam_search(engine, prompts: Sequence[Sequence[int]], params: BeamSearchParams,
                lora_requests: Sequence | None = None) -> list[list[BeamSequence]]:
    """The beam_width best sequences of each prompt, best first. lora_requests: each prompt's
    LoRA adapter (a pagedjax.LoRARequest or None), or None for the base model."""
    loras = list(lora_requests) if lora_requests is not None else [None] * len(prompts)
    width = params.beam_width
    if engine.config.speculative_config is not None:  # as vLLM: beam search does not speculate
        raise ValueError("beam search does not run with speculative_config: use an engine "
                         "without speculative decoding")
    if 2 * width > engine.config.max_logprobs:
        raise RequestError("beam_width", f"beam_width ({width}) needs 2 * beam_width <= max_logprobs "
                         f"({engine.config.max_logprobs})")
    eos = () if params.ignore_eos else engine.model_config.eos_token_ids
    step_params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * width,
                                 ignore_eos=True)
    # All checked, at their longest, before anything runs.
    prompts = [check_prompt_token_ids(p, engine.model_config.vocab_size,
                                      engine.config.max_model_len) for p in prompts]
    check_specs(engine, [PromptSpec([*p, *[0] * (params.max_tokens - 1)], step_params,
                                    lora_request=lora) for p, lora in zip(prompts, loras)])
    live = [[BeamSequence([], 0.0)] for _ in prompts]
    completed: list[list[BeamSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        ids = {(p, b): engine.add_request(list(prompts[p]) + beam.token_ids, step_params,
                                          lora_request=loras[p])
               for p, beams in enumerate(live) for b, beam in enumerate(beams)}
        if not ids:
            break
        top = {}
        while engine.has_unfinished():
            for out in engine.step(final_only=True):
                if out.finished:
                    top[out.request_id] = out.outputs[0].logprobs[0]
        for p, beams in enumerate(live):
            candidates = sorted(
                ((beam.cumulative_logprob + lp.logprob, beam, token)
                 for b, beam in enumerate(beams) for token, lp in top[ids[p, b]].items()),
                key=lambda c: -c[0])
            live[p] = []
            for rank, (cumulative, beam, token) in enumerate(candidates):
                if len(live[p]) == width:
                    break
                sequence = BeamSequence(beam.token_ids + [token], cumulative, token in eos)
                if sequence.finished:
                    if rank < width:  # an ending counts only among the best beam_width
                        completed[p].append(sequence)
                else:
                    live[p].append(sequence)
    results = []
    for p in range(len(prompts)):
        pool = completed[p] + live[p]
        pool.sort(key=lambda s: -s.score(params.length_penalty))
        results.append([_with_text(engine.tokenizer, s) for s in pool[:width]])
    return results


def _with_text(tokenizer, sequence: BeamSequence) -> BeamSequence:
    if tokenizer is None:
        return sequence
    return dataclasses.replace(sequence, text=tokenizer.decode(sequence.token_ids))
