"""LLMEngine's pooling requests (a part of the engine): embeddings, classifications, scores (vLLM's pooling
runner). A pooling request runs its prompt as a generation request of one token would
(chunked, batched with generation in the same steps, prefix-cached when it pools the last
token alone), with its final hidden states returned by the step (BatchPlan.pooling_rows) and
fed to its PooledSequence; the token sampled after its prompt is dropped, and its output is
the pooled data (pagedjax.pooling.pooling_model)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from pagedjax.engine.outputs import PoolingRequestOutput
from pagedjax.engine.request_checks import PromptSpec
from pagedjax.engine.request_table import PoolingState, RequestState
from pagedjax.pooling import step_states
from pagedjax.pooling.params import PoolingParams
from pagedjax.pooling.poolers import PooledSequence
from pagedjax.scheduler import Request, SamplingParams
from pagedjax.scheduler.errors import RequestError

if TYPE_CHECKING:
    from pagedjax.engine.llm_engine import LLMEngine

# what a pooling request runs as: its prompt, then one greedy token nobody reads
PROMPT_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


class PoolingRequests:
    """LLMEngine's pooling side, a part of the engine (engine.pooling): it opens a pooling
    request's pool, feeds it each step's pooled states, and makes its output. (The model's
    pooler and head are engine.pooling_model, which LLM sets from the model's directory.)"""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def start(self, request: Request, params: PoolingParams) -> PoolingState:
        """Marks a built request as pooling (Request.pooling) and opens its pool."""
        pool = self.engine.pooling_model.sequence(params)
        request.pooling = "all" if pool.needs_every_token else "last"
        return PoolingState(pool, params)

    def record(self, output, states: np.ndarray | None) -> None:
        """A step's pooled states (StepResults.pooled) into its pooling requests' pools."""
        step_states.record(output, states, self._pool_of)

    def _pool_of(self, request: Request) -> PooledSequence | None:
        state = self.engine.requests.get(request.parent_id)
        return None if state is None or state.pooling is None else state.pooling.pool

    def output(self, state: RequestState, error: str | None) -> PoolingRequestOutput:
        """A pooling request's output, once its prompt is computed (or it failed)."""
        sample, pooling = state.samples[0], state.pooling
        assert pooling is not None
        data = np.zeros(0, np.float32)
        if error is None and sample.status.value in ("stop", "length"):
            data = self.engine.pooling_model.finish(pooling.pool.result(), pooling.params,
                                                    sample.prompt_token_ids)
        return PoolingRequestOutput.from_sample(sample, data, state.prompt_text, error)


def add_pooling_request(engine, prompt_token_ids: Sequence[int],
                        pooling_params: PoolingParams | None = None, task: str = "embed",
                        request_id: str | None = None, cache_salt: str | None = None,
                        arrival_time: float | None = None) -> str:
    """Queues a pooling request (task: embed, classify, score, token_embed, token_classify) on
    engine (any engine: LLMEngine, EncoderEngine, DataParallelEngine take it as a method) and
    returns its id; RequestError naming the field on bad input."""
    return engine.add_requests([pooling_spec(engine, prompt_token_ids, pooling_params, task,
                                             request_id, None, cache_salt, arrival_time)])[0]


def pooling_spec(engine, prompt_token_ids: Sequence[int], params: PoolingParams | None,
                 task: str, request_id: str | None = None, prompt_text: str | None = None,
                 cache_salt: str | None = None, arrival_time: float | None = None,
                 token_type_ids: Sequence[int] | None = None) -> PromptSpec:
    """A checked pooling request for engine.add_requests (engine: an LLMEngine, an
    EncoderEngine, or the server's view of one in another process): params (None: the
    defaults) verified for task and the engine's model; truncate_prompt_tokens applied (to
    token_type_ids too: a model that reads them, PoolingModel.token_types, only)."""
    params = check_pooling_params(engine, (params or PoolingParams()).verify(task))
    keep, limit = params.truncate_prompt_tokens, engine.config.max_model_len
    ids = _truncated(prompt_token_ids, keep, limit)
    if token_type_ids is not None:
        token_type_ids = _truncated(check_token_type_ids(engine, prompt_token_ids, token_type_ids),
                                    keep, limit)
    return PromptSpec(ids, PROMPT_ONLY, request_id, prompt_text, cache_salt, arrival_time,
                      pooling_params=params, token_type_ids=token_type_ids)


def check_token_type_ids(engine, ids: Sequence[int], types: Sequence[int]) -> list[int]:
    if not engine.pooling_model.token_types:
        raise RequestError("token_type_ids", "this model reads no token type ids")
    kinds = engine.model_config.type_vocab_size
    if (not isinstance(types, (list, tuple)) or len(types) != len(ids)
            or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < kinds
                   for t in types)):
        raise RequestError("token_type_ids", f"token_type_ids must be one integer in [0, "
                           f"{kinds}) for each of the {len(ids)} prompt tokens")
    return list(types)


def check_pooling_params(engine, params) -> PoolingParams:
    """params (a PoolingParams with its task) checked against engine's pooling model, or
    RequestError naming the field."""
    if not isinstance(params, PoolingParams) or params.task is None:
        raise RequestError("pooling_params", "pooling_params must be a PoolingParams "
                           "verified for its task (PoolingParams.verify)")
    engine.pooling_model.check(params.verify(params.task), engine.model_config.hidden_size)
    return params


def _truncated(ids: Sequence[int], keep: int | None, max_model_len: int) -> Sequence[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last keep tokens (-1: max_model_len)."""
    if keep is None:
        return ids
    if isinstance(keep, bool) or not isinstance(keep, int) or not (keep == -1 or keep >= 1):
        raise RequestError("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 or a "
                           f"positive integer, got {keep!r}")
    keep = max_model_len if keep == -1 else keep
    if keep > max_model_len:
        raise RequestError("truncate_prompt_tokens", f"truncate_prompt_tokens ({keep}) "
                           f"exceeds max_model_len ({max_model_len})")
    return list(ids)[-keep:] if hasattr(ids, "__len__") and len(ids) > keep else ids
