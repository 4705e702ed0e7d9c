"""PoolingParams: what a pooling request asks for (vLLM's class and its per-task rule), and the
views of its output (pagedjax.engine.outputs.PoolingRequestOutput) LLM.embed / classify /
score return (vLLM's EmbeddingRequestOutput, ClassificationRequestOutput,
ScoringRequestOutput)."""

from __future__ import annotations

import dataclasses

import numpy as np

from pagedjax.pooling.model_config import check_step_fields
from pagedjax.scheduler.errors import RequestError

# vLLM's pooling tasks: a sequence's embedding, its class probabilities, a pair's score, and
# the per-token forms (every prompt token's embedding / head outputs)
TASKS = ("embed", "classify", "score", "token_embed", "token_classify")
# the fields each task reads (vLLM's PoolingParams.verify refuses the others by name)
# (the STEP pooler's, step_tag_id and returned_token_ids, the token tasks read on a model
# that pools its tokens by STEP: PoolingModel.check)
STEP_FIELDS = ("step_tag_id", "returned_token_ids")
TASK_FIELDS = {"embed": ("dimensions", "normalize"),
               "token_embed": ("dimensions", "normalize") + STEP_FIELDS,
               "classify": ("use_activation",), "score": ("use_activation",),
               "token_classify": ("use_activation",) + STEP_FIELDS}


@dataclasses.dataclass(frozen=True)
class PoolingParams:
    """dimensions: Matryoshka truncation (embed tasks; the model must declare it); normalize:
    L2-normalize the embedding (None: the model's pooler config says); use_activation: the
    head's softmax (several labels) or sigmoid (one label) for classify, score and
    token_classify (None: the pooler config's, on unless it says otherwise, as vLLM's);
    truncate_prompt_tokens: keep the prompt's last k tokens (-1: as many as max_model_len
    allows); step_tag_id, returned_token_ids: a STEP-pooled model's token tasks keep the rows
    of the prompt's step_tag_id tokens and the returned_token_ids columns (None: the pooler
    config's). task is set by the LLM method asking (LLM.embed: embed, ...)."""

    task: str | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    step_tag_id: int | None = None
    returned_token_ids: list[int] | None = None

    def verify(self, task: str) -> "PoolingParams":
        """These params for task, or RequestError naming a field the task does not read."""
        if task not in TASKS:
            raise RequestError("task", f"task must be one of {TASKS}, got {task!r}")
        if self.task is not None and self.task != task:
            raise RequestError("task", f"these pooling params are for task {self.task!r}, "
                               f"asked for {task!r}")
        unread = [f for f in ("dimensions", "normalize", "use_activation") + STEP_FIELDS
                  if getattr(self, f) is not None and f not in TASK_FIELDS[task]]
        if unread:
            raise RequestError(unread[0], f"task {task!r} supports only "
                               f"{list(TASK_FIELDS[task])}, not {unread}")
        for field in ("normalize", "use_activation"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, bool):
                raise RequestError(field, f"{field} must be a boolean, got {value!r}")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(
                self.dimensions, int) or self.dimensions < 1):
            raise RequestError("dimensions", f"dimensions must be a positive integer, got "
                               f"{self.dimensions!r}")
        self._verify_step_fields()
        return dataclasses.replace(self, task=task)

    def _verify_step_fields(self) -> None:
        try:
            check_step_fields(self.step_tag_id, self.returned_token_ids)
        except ValueError as error:
            field = next(f for f in STEP_FIELDS if str(error).startswith(f))
            raise RequestError(field, str(error)) from None


@dataclasses.dataclass(frozen=True)
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclasses.dataclass(frozen=True)
class ClassificationOutput:
    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclasses.dataclass(frozen=True)
class ScoringOutput:
    score: float


@dataclasses.dataclass(frozen=True)
class TypedRequestOutput:
    """vLLM's EmbeddingRequestOutput / ClassificationRequestOutput / ScoringRequestOutput: a
    PoolingRequestOutput whose outputs is the task's view (view_of)."""

    request_id: str
    outputs: EmbeddingOutput | ClassificationOutput | ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


def view_of(output, task: str) -> TypedRequestOutput:
    """output as LLM.embed / classify / score return it."""
    data = np.asarray(output.outputs.data, np.float32)
    view: EmbeddingOutput | ClassificationOutput | ScoringOutput
    if task == "embed":
        view = EmbeddingOutput(data.tolist())
    elif task == "classify":
        view = ClassificationOutput(data.tolist())
    elif task == "score":
        view = ScoringOutput(float(data.reshape(-1)[0]))
    else:
        raise ValueError(f"no typed view for task {task!r}")
    return TypedRequestOutput(output.request_id, view, output.prompt_token_ids, output.finished,
                              output.prompt)
