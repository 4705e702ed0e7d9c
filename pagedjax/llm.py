"""LLM: the offline batch API, a thin layer over LLMEngine."""

from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
from tqdm.auto import tqdm

from models import LlamaForCausalLM, get_config, init_model
from pagedjax.beam_search import BeamSearchParams, BeamSequence, beam_search
from pagedjax.config import EngineConfig
from pagedjax.engine import LLMEngine
from pagedjax.outputs import RequestOutput
from scheduler import SamplingParams


def load_model(model: str | LlamaForCausalLM, seed: int = 0,
               dtype: str = "float32") -> LlamaForCausalLM:
    """A model object as is, or a named config from models.CONFIGS with seeded random weights
    (parameters in f32, activations in dtype)."""
    if isinstance(model, LlamaForCausalLM):
        return model
    if isinstance(model, str):
        compute_dtype = jnp.bfloat16 if dtype == "bfloat16" else jnp.float32
        return init_model(get_config(model), seed=seed, dtype=compute_dtype)
    raise ValueError(f"model must be a config name or a LlamaForCausalLM, got {type(model)}")


class LLM:
    """Offline generation: `LLM("demo-small").generate([[1, 2, 3]], SamplingParams())`."""

    def __init__(self, model: str | LlamaForCausalLM = "demo-small", **engine_kwargs):
        config = EngineConfig.from_kwargs(**engine_kwargs)
        self.engine = LLMEngine(load_model(model, seed=config.seed, dtype=config.dtype), config)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt (lists of token ids); outputs come back in prompt order.

        Every request is validated before any is queued, so a bad one rejects the whole call and
        leaves the engine as it was.
        """
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if isinstance(prompts[0], int):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for "
                             f"{len(prompts)} prompts")
        engine = self.engine
        requests = [engine.make_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        ids = [r.parent_id for r in requests]
        if len(set(ids)) != len(ids):
            raise ValueError("request ids must be unique")
        for request in requests:
            engine.scheduler.check_request(request)
        for request in requests:
            engine.queue(request)
        outputs: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out
                        bar.update(1)
        return [outputs[r.parent_id] for r in requests]

    def beam_search(self, prompts: Sequence[Sequence[int]],
                    params: BeamSearchParams) -> list[list[BeamSequence]]:
        """The params.beam_width best continuations of each prompt, best first."""
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of token-id lists")
        if self.engine.has_unfinished():
            raise ValueError("beam_search needs an idle engine")
        return beam_search(self.engine, prompts, params)
