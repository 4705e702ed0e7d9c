"""EncoderEngine: pooling requests on a bidirectional encoder (BERT-like: models.families.bert).

Why not the paged engine: in an encoder every token attends to every other token of its
sequence, so no state of a sequence exists before all of it is in (no chunked prefill), no
prefix is shared (a prefix's states depend on what follows it), and nothing is decoded (no
KV cache to keep). Its prompts are short (512 positions). So each step takes up to
max_num_seqs waiting requests, pads them to a [B, L] batch (B and L powers of two: a bounded
number of compiled programs) and runs the dense encoder on it, one jit program per shape;
each request's rows are pooled (pagedjax.pooling) and it finishes in that step.

It answers what LLM's pooling methods ask of an engine (pooling_spec, add_requests, step,
has_unfinished), with the paged engine's request checks for what applies.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.engine.config import EngineConfig
from pagedjax.engine.outputs import PoolingOutput, PoolingRequestOutput, RequestMetrics
from pagedjax.engine.pooling_requests import check_pooling_params, pooling_spec
from pagedjax.engine.request_checks import PromptSpec, check_prompt_token_ids
from pagedjax.pooling.pooling_model import PoolingModel
from pagedjax.scheduler.errors import RequestError

MIN_LENGTH = 16  # the shortest padded length


@dataclasses.dataclass
class _Queued:
    request_id: str
    ids: list[int]
    spec: PromptSpec
    arrival_time: float


def bucket(n: int, least: int, most: int) -> int:
    """The power of two >= n (at least `least`), capped at most."""
    return min(most, max(least, 1 << max(0, n - 1).bit_length()))


class EncoderEngine:
    runner_type = "pooling"
    # LLM's pooling methods drive it; the server's front-end (admission, metrics, the engine
    # core) needs the paged engine's books, which it has not: not served over HTTP yet
    serves_http = False

    def __init__(self, model, config: EngineConfig, pooling_model: PoolingModel, *,
                 tokenizer=None, clock: Callable[[], float] = time.perf_counter):
        self.config = dataclasses.replace(
            config, max_model_len=min(config.max_model_len, model.config.max_tokens))
        self.model_config = model.config
        self.pooling_model = pooling_model
        self.tokenizer = tokenizer
        self.clock = clock
        graph, state = nnx.split(model)
        self._state = state
        self._forward = jax.jit(lambda s, ids, mask: nnx.merge(graph, s)(ids, mask))
        self._waiting: collections.deque[_Queued] = collections.deque()
        self._next_id = 0

    def pooling_spec(self, prompt_token_ids, params, task: str, request_id=None,
                     prompt_text=None, cache_salt=None, arrival_time=None) -> PromptSpec:
        return pooling_spec(self, prompt_token_ids, params, task, request_id, prompt_text,
                            cache_salt, arrival_time)

    def check_pooling_params(self, params):
        return check_pooling_params(self, params)

    def add_requests(self, specs: Sequence[PromptSpec]) -> list[str]:
        """Queues pooling requests all or none; RequestError naming the field otherwise."""
        checked = []
        taken = {q.request_id for q in self._waiting}
        for i, spec in enumerate(specs):
            if spec.pooling_params is None:
                raise RequestError(None, "an encoder serves pooling requests only")
            self.check_pooling_params(spec.pooling_params)
            ids = check_prompt_token_ids(spec.prompt_token_ids, self.model_config.vocab_size,
                                         self.config.max_model_len)
            request_id = spec.request_id or f"enc-{self._next_id + i}"
            if request_id in taken:
                raise RequestError("request_id", f"request_id {request_id!r} is already in use")
            taken.add(request_id)
            checked.append((request_id, ids, spec))
        self._next_id += len(specs)
        now = self.clock()
        for request_id, ids, spec in checked:
            self._waiting.append(_Queued(request_id, ids, spec, spec.arrival_time or now))
        return [request_id for request_id, _, _ in checked]

    def has_unfinished(self) -> bool:
        return bool(self._waiting)

    def abort(self, request_id: str) -> None:
        self._waiting = collections.deque(q for q in self._waiting
                                          if q.request_id != request_id)

    def step(self, final_only: bool = False) -> list[PoolingRequestOutput]:
        """Encodes up to max_num_seqs waiting requests as one padded batch; their outputs."""
        if not self._waiting:
            return []
        batch = [self._waiting.popleft()
                 for _ in range(min(len(self._waiting), self.config.max_num_seqs))]
        start = self.clock()
        length = bucket(max(len(q.ids) for q in batch), MIN_LENGTH, self.config.max_model_len)
        rows = bucket(len(batch), 1, self.config.max_num_seqs)
        ids = np.zeros((rows, length), np.int32)
        mask = np.zeros((rows, length), bool)
        for row, queued in enumerate(batch):
            ids[row, :len(queued.ids)] = queued.ids
            mask[row, :len(queued.ids)] = True
        states = np.asarray(self._forward(self._state, jnp.asarray(ids), jnp.asarray(mask)),
                            np.float32)
        done = self.clock()
        return [self._output(q, states[row, :len(q.ids)], start, done)
                for row, q in enumerate(batch)]

    def _output(self, queued: _Queued, states: np.ndarray, start: float,
                done: float) -> PoolingRequestOutput:
        params = queued.spec.pooling_params
        pool = self.pooling_model.sequence(params)
        pool.add(states, 0)
        data = self.pooling_model.finish(pool.result(), params)
        metrics = RequestMetrics(queued.arrival_time, start, done, done, 0, 0)
        return PoolingRequestOutput(queued.request_id, PoolingOutput(data), queued.ids, True,
                                    metrics, queued.spec.prompt_text)
