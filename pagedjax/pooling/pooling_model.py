"""What an engine serves pooling requests with: the model's pooler (model_config.PoolerConfig)
and its classification head (heads.ClassifierHead, or None); checks a request's PoolingParams
against them before anything is built, and turns a finished request's pooled states into its
output data."""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.pooling.heads import ClassifierHead
from pagedjax.pooling.model_config import PoolerConfig
from pagedjax.pooling.params import PoolingParams
from pagedjax.pooling.poolers import PooledSequence, finish_embedding
from pagedjax.scheduler.errors import RequestError

HEAD_TASKS = ("classify", "score", "token_classify")


@dataclasses.dataclass(frozen=True)
class PoolingModel:
    pooler: PoolerConfig = PoolerConfig()
    head: ClassifierHead | None = None
    token_types: bool = False  # the model reads token type ids (BERT's segments of a pair)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks it serves: embeddings always, the head's tasks with a head."""
        return ("embed", "token_embed") + (HEAD_TASKS if self.head is not None else ())

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """RequestError naming the field a request asks for and this model cannot serve."""
        if params.task not in self.tasks:
            raise RequestError("task", f"task {params.task!r} needs a classification head "
                               "(a *ForSequenceClassification checkpoint, or "
                               "classifier_from_token); this model serves "
                               f"{list(self.tasks)}")
        if params.dimensions is not None:
            try:
                finish_embedding(np.zeros(hidden_size * len(self.pooler.modes), np.float32),
                                 normalize=False, dimensions=params.dimensions,
                                 matryoshka=self.pooler.matryoshka)
            except ValueError as error:
                raise RequestError("dimensions", str(error)) from None

    def sequence(self, params: PoolingParams) -> PooledSequence:
        """The running pool a request of params feeds: every token's state for the token
        tasks, the pooler's modes otherwise."""
        modes = ("all",) if params.task.startswith("token_") else self.pooler.modes
        return PooledSequence(modes)

    def finish(self, pooled: np.ndarray, params: PoolingParams) -> np.ndarray:
        """A request's output data from its pooled states (PooledSequence.result)."""
        if params.task in ("embed", "token_embed"):
            normalize = self.pooler.normalize if params.normalize is None else params.normalize
            return finish_embedding(pooled, normalize=normalize, dimensions=params.dimensions,
                                    matryoshka=self.pooler.matryoshka)
        default = params.task != "token_classify"  # a reward model's raw scores by default
        use_activation = default if params.use_activation is None else params.use_activation
        return self.head(pooled, use_activation)
