"""What an engine serves pooling requests with: the model's pooler (model_config.PoolerConfig)
and its classification head (heads.ClassifierHead, or None); checks a request's PoolingParams
against them before anything is built, and turns a finished request's pooled states into its
output data."""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.pooling.heads import ClassifierHead, activated
from pagedjax.pooling.model_config import PoolerConfig
from pagedjax.pooling.params import STEP_FIELDS, PoolingParams
from pagedjax.pooling.poolers import PooledSequence, finish_embedding, step_rows
from pagedjax.scheduler.errors import RequestError

HEAD_TASKS = ("classify", "score", "token_classify")


@dataclasses.dataclass(frozen=True)
class PoolingModel:
    pooler: PoolerConfig = PoolerConfig()
    head: ClassifierHead | None = None
    token_types: bool = False  # the model reads token type ids (BERT's segments of a pair)
    reward: bool = False  # a reward model (its per-token scores are what /pooling returns)

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks it serves: embeddings always, the head's tasks with a head."""
        return ("embed", "token_embed") + (HEAD_TASKS if self.head is not None else ())

    @property
    def default_task(self) -> str:
        """What a /pooling request without a task asks for: a reward model's per-token
        scores, a classifier's probabilities, an embedder's embedding."""
        if self.head is None:
            return "embed"
        return "token_classify" if self.reward else "classify"

    def check(self, params: PoolingParams, hidden_size: int) -> None:
        """RequestError naming the field a request asks for and this model cannot serve."""
        if params.task not in self.tasks:
            raise RequestError("task", f"task {params.task!r} needs a classification head "
                               "(a *ForSequenceClassification checkpoint, or "
                               "classifier_from_token); this model serves "
                               f"{list(self.tasks)}")
        self._check_step_fields(params, hidden_size)
        if params.dimensions is not None:
            try:
                finish_embedding(np.zeros(hidden_size * len(self.pooler.modes), np.float32),
                                 normalize=False, dimensions=params.dimensions,
                                 matryoshka=self.pooler.matryoshka)
            except ValueError as error:
                raise RequestError("dimensions", str(error)) from None

    def _check_step_fields(self, params: PoolingParams, hidden_size: int) -> None:
        given = [f for f in STEP_FIELDS if getattr(params, f) is not None]
        if given and self.pooler.token_pooling != "STEP":
            raise RequestError(given[0], f"{given[0]} is read by a model whose token tasks "
                               "pool by STEP (a process reward model, or --pooler-config "
                               "pooling_type STEP); this model's pool ALL tokens")
        task = _task(params)
        if not task.startswith("token_"):
            return
        columns = (self.classifier.num_labels if task == "token_classify" else hidden_size)
        ids = params.returned_token_ids or self.pooler.returned_token_ids or ()
        if any(i >= columns for i in ids):
            raise RequestError("returned_token_ids", f"returned_token_ids index the {columns} "
                               f"columns of the {params.task} outputs, got {list(ids)}")

    def sequence(self, params: PoolingParams) -> PooledSequence:
        """The running pool a request of params feeds: every token's state for the token
        tasks, the pooler's modes otherwise."""
        modes = ("all",) if _task(params).startswith("token_") else self.pooler.modes
        return PooledSequence(modes)

    def finish(self, pooled: np.ndarray, params: PoolingParams,
               prompt_token_ids=None) -> np.ndarray:
        """A request's output data from its pooled states (PooledSequence.result); a token
        task of a STEP-pooled model keeps the rows of the prompt's (prompt_token_ids')
        step_tag_id tokens and the returned_token_ids columns, before the normalization or
        the activation (vLLM's order)."""
        task = _task(params)
        if task in HEAD_TASKS:
            pooled = self.classifier.logits(pooled)
        if task.startswith("token_"):
            pooled = self._step_pooled(pooled, params, prompt_token_ids)
        if task in ("embed", "token_embed"):
            normalize = self.pooler.normalize if params.normalize is None else params.normalize
            return finish_embedding(pooled, normalize=normalize, dimensions=params.dimensions,
                                    matryoshka=self.pooler.matryoshka)
        if self.pooler.logit_bias is not None:
            pooled = pooled - np.float32(self.pooler.logit_bias)
        use_activation = next(v for v in (params.use_activation, self.pooler.use_activation,
                                          True) if v is not None)
        return activated(pooled, self.classifier.activation(task)) if use_activation else pooled

    @property
    def classifier(self) -> ClassifierHead:
        """The classification head, which the head tasks need (check refuses them without)."""
        if self.head is None:
            raise RequestError("task", "this model has no classification head")
        return self.head

    def _step_pooled(self, rows: np.ndarray, params: PoolingParams, prompt_token_ids):
        if self.pooler.token_pooling != "STEP":
            return rows
        # a request's own fields, else the pooler config's
        tag = self.pooler.step_tag_id if params.step_tag_id is None else params.step_tag_id
        columns = params.returned_token_ids or self.pooler.returned_token_ids
        return step_rows(rows, prompt_token_ids, tag, columns)


def _task(params: PoolingParams) -> str:
    """The task params were verified for (PoolingParams.verify sets it)."""
    if params.task is None:
        raise RequestError("task", "pooling params without a task (PoolingParams.verify)")
    return params.task
