"""Classification heads of pooling models, applied on the host to the pooled vector (f32):
a sequence classifier's projection, after the layers some checkpoints put before it (BERT's
pooler, RoBERTa's and ModernBERT's classifier MLP, a Qwen2 reward model's two-layer score:
pagedjax.pooling.checkpoint_heads reads them), or one built from the language-model head's
rows of some tokens (vLLM's classifier_from_token: Qwen3-Reranker's ["no", "yes"] becomes one
label scoring yes over no, whose sigmoid is the two-way softmax's probability of yes)."""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import numpy as np

from pagedjax.models.loading.hf import weight_files

_erf = np.vectorize(math.erf, otypes=[np.float64])
Activation = Callable[[np.ndarray], np.ndarray]
ACTIVATIONS: dict[str, Activation] = {"identity": lambda x: x, "tanh": np.tanh, "relu": lambda x: np.maximum(x, 0),
               "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
               "gelu_pytorch_tanh": lambda x: 0.5 * x * (1.0 + np.tanh(
                   math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))}
ACTIVATIONS["gelu_new"] = ACTIVATIONS["gelu_pytorch_tanh"]


@dataclasses.dataclass(frozen=True)
class DenseLayer:
    """activation(x W^T + b), then a LayerNorm when norm is given: (scale, bias or None, eps)."""

    weight: np.ndarray  # f32[out, in]
    bias: np.ndarray | None = None
    activation: str = "identity"
    norm: tuple | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"classifier activation {self.activation!r} is not served "
                             f"({', '.join(ACTIVATIONS)})")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        y = ACTIVATIONS[self.activation](y).astype(np.float32)
        if self.norm is None:
            return y
        scale, shift, eps = self.norm
        y = (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + eps) * scale
        return y if shift is None else y + shift


@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    weight: np.ndarray  # f32[labels, D']: the last projection
    bias: np.ndarray | None = None  # f32[labels]
    source: str = "score"
    labels: tuple[str, ...] = ()  # each label's name (config.json's id2label), in order
    hidden: tuple[DenseLayer, ...] = ()  # applied in order before the projection
    # the activation classify and score apply (OUTPUT_ACTIVATIONS; vLLM's reading of the
    # config: head_activations); token_classify's is always "classify"
    classify_activation: str = "classify"
    score_activation: str = "classify"

    def __post_init__(self):
        for name in (self.classify_activation, self.score_activation):
            if name not in OUTPUT_ACTIVATIONS:
                raise ValueError(f"head activation {name!r} is not served "
                                 f"({', '.join(OUTPUT_ACTIVATIONS)})")

    def activation(self, task: str) -> str:
        return {"classify": self.classify_activation, "score": self.score_activation}.get(
            task, "classify")

    def label(self, index: int) -> str:
        return self.labels[index] if index < len(self.labels) else f"LABEL_{index}"

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def logits(self, vectors: np.ndarray) -> np.ndarray:
        """[..., D] -> f32[..., labels]: the hidden layers, then the projection."""
        x = np.asarray(vectors, np.float32)
        for layer in self.hidden:
            x = layer(x)
        logits = x @ self.weight.T
        return logits if self.bias is None else logits + self.bias


def _classify(logits: np.ndarray) -> np.ndarray:
    """vLLM's PoolerClassify over the last axis: the sigmoid of one label, the softmax of
    several."""
    if logits.shape[-1] == 1:
        return _sigmoid(logits)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


# what a head's outputs go through: vLLM's PoolerClassify, PoolerMultiLabelClassify (a
# multi-label classifier: each label's sigmoid), PoolerIdentity (a regression's raw value),
# and the cross-encoder activations sentence-transformers configs name
OUTPUT_ACTIVATIONS: dict[str, Activation] = {"classify": _classify, "multi_label": _sigmoid,
                      "identity": lambda x: x, "tanh": np.tanh}


def activated(logits: np.ndarray, activation: str = "classify") -> np.ndarray:
    return OUTPUT_ACTIVATIONS[activation](logits).astype(np.float32)


def token_rows(model, model_dir: str | None, token_ids: list[int]) -> np.ndarray:
    """f32[len(token_ids), D]: the language-model head's rows of token_ids (the tied
    embedding's when the model has none), from model_dir's safetensors when given (an engine
    reads its model into place: no host copy to take them from), else from model's params."""
    vocab = model.config.vocab_size
    if not token_ids or any(not 0 <= t < vocab for t in token_ids):
        raise ValueError(f"classifier_from_token: token ids must be in [0, {vocab}), got "
                         f"{token_ids}")
    if model_dir is not None:
        from safetensors import safe_open

        files = weight_files(model_dir)
        name = "lm_head.weight" if "lm_head.weight" in files else "model.embed_tokens.weight"
        with safe_open(files[name], framework="numpy") as f:
            table = f.get_slice(name)
            return np.stack([np.asarray(table[t:t + 1], np.float32)[0] for t in token_ids])
    if model.lm_head is None:
        return np.asarray(model.embed_tokens.embedding[...], np.float32)[token_ids]
    return np.asarray(model.lm_head.kernel[...], np.float32)[:, token_ids].T


def head_from_tokens(rows: np.ndarray, tokens: list[str]) -> ClassifierHead:
    """vLLM's classifier_from_token over token_rows (of tokens' ids): one label a token; two
    tokens give one label, the second's row minus the first's (its sigmoid = the two-way
    softmax of the second)."""
    if len(tokens) == 2:
        rows, tokens = rows[1:] - rows[:1], tokens[1:]
    return ClassifierHead(np.asarray(rows, np.float32), None,
                          f"classifier_from_token {tokens}", tuple(tokens))
