"""Classification heads of pooling models, applied on the host to the pooled vector (f32):
a sequence classifier's `score` projection (transformers' *ForSequenceClassification: reward
models, cross-encoder rerankers), or one built from the language-model head's rows of some
tokens (vLLM's classifier_from_token: Qwen3-Reranker's ["no", "yes"] becomes one label
scoring yes over no, whose sigmoid is the two-way softmax's probability of yes)."""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from pagedjax.models.families.hf_fields import architecture_of
from pagedjax.models.loading.hf import weight_files
from pagedjax.models.loading.hf_config import is_sequence_classifier

HEAD_NAMES = ("score.weight", "score.bias")


@dataclasses.dataclass(frozen=True)
class ClassifierHead:
    weight: np.ndarray  # f32[labels, D]
    bias: np.ndarray | None = None  # f32[labels]
    source: str = "score"
    labels: tuple[str, ...] = ()  # each label's name (config.json's id2label), in order

    def label(self, index: int) -> str:
        return self.labels[index] if index < len(self.labels) else f"LABEL_{index}"

    @property
    def num_labels(self) -> int:
        return self.weight.shape[0]

    def __call__(self, vectors: np.ndarray, use_activation: bool) -> np.ndarray:
        """[..., D] -> f32[..., labels]: the logits, or with use_activation their softmax
        (several labels) or sigmoid (one: vLLM's rule)."""
        logits = np.asarray(vectors, np.float32) @ self.weight.T
        if self.bias is not None:
            logits = logits + self.bias
        if not use_activation:
            return logits
        if self.num_labels == 1:
            return 1.0 / (1.0 + np.exp(-logits))
        shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
        return shifted / shifted.sum(axis=-1, keepdims=True)


def read_score_head(model_dir: str, hf_config: dict) -> ClassifierHead | None:
    """A *ForSequenceClassification checkpoint's score head (its num_labels rows), or None for
    another architecture."""
    if not is_sequence_classifier(hf_config):
        return None
    from safetensors import safe_open

    files = weight_files(model_dir)
    if HEAD_NAMES[0] not in files:
        raise ValueError(f"{model_dir}: a {architecture_of(hf_config)} checkpoint without "
                         f"{HEAD_NAMES[0]}")
    tensors = {}
    for name in HEAD_NAMES:
        if name in files:
            with safe_open(files[name], framework="numpy") as f:
                tensors[name] = np.asarray(f.get_tensor(name), np.float32)
    weight = tensors[HEAD_NAMES[0]]
    labels = hf_config.get("num_labels", len(hf_config.get("id2label") or {}) or weight.shape[0])
    if weight.ndim != 2 or weight.shape[0] != labels:
        raise ValueError(f"{model_dir}: {HEAD_NAMES[0]} has shape {weight.shape}, "
                         f"num_labels is {labels}")
    names = hf_config.get("id2label") or {}
    return ClassifierHead(weight, tensors.get(HEAD_NAMES[1]),
                          f"{os.path.basename(model_dir.rstrip('/'))}: score",
                          tuple(str(names.get(str(i), f"LABEL_{i}")) for i in range(labels)))


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
