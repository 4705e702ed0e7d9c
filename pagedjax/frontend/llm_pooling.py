"""LLM's pooling side (a mixin; vLLM's names): embed, classify, score, reward and encode on an
LLM built with runner="pooling" (a *ForSequenceClassification checkpoint implies it), and
the runner rule both ways: generation on a pooling LLM, pooling on a generating one, refused
by name."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
from tqdm.auto import tqdm

from pagedjax.engine.outputs import PoolingOutput, PoolingRequestOutput
from pagedjax.engine.request_checks import encode_pair
from pagedjax.frontend.pooling_setup import pooling_setup
from pagedjax.frontend.prompt_inputs import prompt_input
from pagedjax.pooling import scoring
from pagedjax.pooling.params import PoolingParams, view_of
from pagedjax.scheduler import RequestError

if TYPE_CHECKING:
    from pagedjax.engine.encoder_engine import EncoderEngine
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.frontend.data_parallel import DataParallelEngine


class PoolingAPI:
    """LLM's pooling methods (over its engine and tokenizer)."""

    runner: str = "generate"
    engine: LLMEngine | DataParallelEngine | EncoderEngine
    tokenizer: Any

    def _init_runner(self, runner: str, pooling_model) -> None:
        """The runner served (resolve_runner's) and, for "pooling", the engine's PoolingModel
        (pooling_setup's, read and checked before the engine was built)."""
        self.runner = runner
        if pooling_model is not None:
            self.engine.pooling_model = pooling_model

    def _init_encoder(self, path: str, tokenizer, config) -> None:
        """A BERT-like encoder (pagedjax.engine.encoder_engine: dense, no KV cache), read
        whole; what the paged engine's parallelism and quantization fields ask is refused.
        tokenizer: LLM's argument, loaded (None: the directory's tokenizer.json, if any)."""
        from pagedjax.engine.encoder_engine import EncoderEngine
        from pagedjax.models.loading.encoder import load_encoder
        from pagedjax.text.tokenizer import Tokenizer

        for field, plain in (("tensor_parallel_size", 1), ("data_parallel_size", 1),
                             ("quantization", None), ("enable_lora", False),
                             ("speculative_config", None)):
            if getattr(config, field) != plain:
                raise ValueError(f"{field}: a BERT-like encoder runs on one device, in float "
                                 f"(got {getattr(config, field)!r})")
        loaded = load_encoder(path, config.dtype)
        self.tokenizer = tokenizer or (
            Tokenizer.from_dir(path) if os.path.isfile(os.path.join(path, "tokenizer.json"))
            else None)
        pooling_model = pooling_setup(path, loaded, self.tokenizer, "pooling",
                                      config.pooler_config, config.hf_overrides, config.convert)
        if pooling_model is None:  # pooling_setup's for runner "pooling" is one
            raise RuntimeError(f"{path}: no pooling model for the encoder")
        self.engine = EncoderEngine(loaded, config, pooling_model, tokenizer=self.tokenizer)
        self._dtype = config.dtype
        self.runner = "pooling"

    def check_runner(self, wanted: str, method: str) -> None:
        if self.runner != wanted:
            raise ValueError(f"LLM.{method} needs runner={wanted!r}; this LLM was built with "
                             f"runner={self.runner!r}")

    def encode(self, prompts: str | Sequence[Any],
               pooling_params: PoolingParams | Sequence[PoolingParams | None] | None = None,
               use_tqdm: bool = True, pooling_task: str = "embed",
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Every prompt's pooled data (outputs.data) for pooling_task: embed, classify,
        score, token_embed or token_classify; prompts as generate takes them."""
        self.check_runner("pooling", "encode")
        prompts = [prompts] if isinstance(prompts, str) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)
        ) else prompts
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise RequestError("prompts", "prompts must be a non-empty list of strings or "
                               "token-id lists")
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise RequestError("pooling_params", f"pooling_params has {len(pooling_params)} "
                               f"entries for {len(prompts)} prompts")
        specs = []
        for prompt, params in zip(prompts, pooling_params):
            ids, text = prompt_input(self.tokenizer, prompt)
            if truncate_prompt_tokens is not None:
                params = PoolingParams(**{**vars(params or PoolingParams()),
                                          "truncate_prompt_tokens": truncate_prompt_tokens})
            specs.append(self.engine.pooling_spec(ids, params, pooling_task, prompt_text=text))
        return self._run_pooling(specs, use_tqdm, pooling_task)

    def _run_pooling(self, specs, use_tqdm: bool, task: str) -> list[PoolingRequestOutput]:
        engine = self.engine
        request_ids = engine.add_requests(specs)
        outputs: dict[str, PoolingRequestOutput] = {}
        with tqdm(total=len(request_ids), desc=task, disable=not use_tqdm) as bar:
            while engine.has_unfinished():
                for out in engine.step(final_only=True):
                    if isinstance(out, PoolingRequestOutput) and out.finished:
                        outputs[out.request_id] = out
                        bar.update(1)
        failed = [outputs[i].error for i in request_ids if outputs[i].error is not None]
        if failed:
            raise RuntimeError(f"a pooling request failed inside a step: {failed[0]}")
        return [outputs[i] for i in request_ids]

    def embed(self, prompts, pooling_params=None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list:
        """Each prompt's embedding (outputs.embedding)."""
        return [view_of(o, "embed") for o in self.encode(
            prompts, pooling_params, use_tqdm, "embed", truncate_prompt_tokens)]

    def classify(self, prompts, pooling_params=None, use_tqdm: bool = True,
                 truncate_prompt_tokens: int | None = None) -> list:
        """Each prompt's class probabilities (outputs.probs)."""
        return [view_of(o, "classify") for o in self.encode(
            prompts, pooling_params, use_tqdm, "classify", truncate_prompt_tokens)]

    def reward(self, prompts, pooling_params=None, use_tqdm: bool = True,
               truncate_prompt_tokens: int | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's per-token rewards (outputs.data f32[tokens, labels]: the head's raw
        outputs at every prompt token; the last row is a sequence reward model's score)."""
        return self.encode(prompts, pooling_params, use_tqdm, "token_classify",
                           truncate_prompt_tokens)

    def score(self, data_1, data_2, pooling_params=None, use_tqdm: bool = True,
              truncate_prompt_tokens: int | None = None) -> list:
        """vLLM's score: each (data_1, data_2) pair's score (outputs.score), data_1 one text
        (or token ids) against every data_2, or lists of equal length pairwise
        (pagedjax.pooling.scoring: a cross-encoder's head, or an embedding model's cosine)."""
        self.check_runner("pooling", "score")
        one = lambda d: isinstance(d, str) or (  # noqa: E731
            isinstance(d, (list, tuple)) and d and isinstance(d[0], int))
        firsts, seconds = scoring.pairs([data_1] if one(data_1) else list(data_1),
                                        [data_2] if one(data_2) else list(data_2))
        head = self.engine.pooling_model.head
        scoring.check_cross_encoder(head)
        if head is not None:
            return [view_of(o, "score") for o in self._scored_pairs(
                firsts, seconds, pooling_params, use_tqdm, truncate_prompt_tokens)]
        if pooling_params is not None:
            raise RequestError("pooling_params", "an embedding model's score is the cosine of "
                               "two embeddings: it reads no pooling_params")
        vectors = self.encode(list(firsts) + list(seconds), None, use_tqdm, "embed",
                              truncate_prompt_tokens)
        return [view_of(dataclasses.replace(
            a, outputs=PoolingOutput(np.asarray([scoring.cosine(a.outputs.data,
                                                               b.outputs.data)], np.float32)),
            prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids), "score")
            for a, b in zip(vectors[:len(firsts)], vectors[len(firsts):])]

    def _scored_pairs(self, firsts, seconds, pooling_params, use_tqdm: bool,
                      truncate_prompt_tokens) -> list[PoolingRequestOutput]:
        """A cross-encoder's outputs of each pair read as one prompt (encode_pair), with its
        token types when the model reads them."""
        if pooling_params is not None and not isinstance(pooling_params, PoolingParams):
            raise RequestError("pooling_params", "score takes one PoolingParams for all pairs")
        params = pooling_params or PoolingParams()
        if truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=truncate_prompt_tokens)
        reads_types = self.engine.pooling_model.token_types
        specs = []
        for a, b in zip(firsts, seconds):
            ids, types = encode_pair(self.tokenizer, *(
                t if isinstance(t, str) else list(prompt_input(self.tokenizer, t)[0])
                for t in (a, b)))
            specs.append(self.engine.pooling_spec(ids, params, "score", token_type_ids=(
                types if reads_types else None)))
        return self._run_pooling(specs, use_tqdm, "score")
