"""The classification head a pooling checkpoint carries, read from its safetensors under
transformers' names into a heads.ClassifierHead:

    <Decoder>ForSequenceClassification    score                      (reward models, rerankers)
    BertForSequenceClassification         pooler.dense + tanh, classifier   (cross-encoders)
    (XLM-)RobertaForSequenceClassification classifier.dense + tanh, classifier.out_proj
                                                                    (bge-reranker)
    ModernBertForSequenceClassification   head.dense + activation + head.norm, classifier
    Qwen2ForRewardModel                   score.0 + ReLU, score.2    (Qwen2.5-Math-RM: one label)
    Qwen2ForProcessRewardModel            score.0 + ReLU, score.2    (Qwen2.5-Math-PRM: two)

Every tensor is checked for its shape: a head that does not chain from the model's hidden size
to its labels is refused by name, never applied.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from pagedjax.models.families.hf_fields import architecture_of
from pagedjax.models.loading.hf import weight_files
from pagedjax.models.loading.hf_config import REWARD_MODELS, is_sequence_classifier
from pagedjax.pooling.heads import ClassifierHead, DenseLayer

PREFIXES = ("", "bert.", "model.")  # where a task model keeps its base model's tensors


@dataclasses.dataclass(frozen=True)
class HeadLayout:
    """A head's tensors: (name, activation, its LayerNorm's name or None) for each layer
    before the projection, then the projection's name (each `<name>.weight` and `.bias`)."""

    hidden: tuple[tuple[str, str, str | None], ...]
    projection: str


def head_layout(hf_config: dict) -> HeadLayout | None:
    """Where config.json's architecture keeps its head (module docstring), or None for a
    model without one."""
    architecture = architecture_of(hf_config)
    if architecture in REWARD_MODELS:
        return HeadLayout((("score.0", "relu", None),), "score.2")
    if not is_sequence_classifier(hf_config):
        return None
    model_type = hf_config.get("model_type")
    if model_type == "bert":
        return HeadLayout((("pooler.dense", "tanh", None),), "classifier")
    if model_type in ("roberta", "xlm-roberta"):
        return HeadLayout((("classifier.dense", "tanh", None),), "classifier.out_proj")
    if model_type == "modernbert":
        activation = hf_config.get("classifier_activation", "gelu")
        return HeadLayout((("head.dense", activation, "head.norm"),), "classifier")
    return HeadLayout((), "score")


class _Tensors:
    """A checkpoint's tensors by transformers' name, under any of PREFIXES."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.files = weight_files(model_dir)

    def get(self, name: str) -> np.ndarray:
        found = self.find(name)
        if found is None:
            raise ValueError(f"{self.model_dir}: its classification head has no {name}")
        return found

    def find(self, name: str) -> np.ndarray | None:
        """name's tensor (f32), or None when the checkpoint has none."""
        from safetensors import safe_open

        stored = next((p + name for p in PREFIXES if p + name in self.files), None)
        if stored is None:
            return None
        with safe_open(self.files[stored], framework="numpy") as f:
            return np.asarray(f.get_tensor(stored), np.float32)


def _checked(tensors: _Tensors, name: str, rows: int | None, columns: int) -> tuple:
    """(weight [rows, columns], bias or None) of name; ValueError naming a misfit."""
    weight, bias = tensors.get(f"{name}.weight"), tensors.find(f"{name}.bias")
    rows = weight.shape[0] if rows is None else rows
    if weight.shape != (rows, columns) or (bias is not None and bias.shape != (rows,)):
        raise ValueError(f"{tensors.model_dir}: {name}.weight has shape {weight.shape} (bias "
                         f"{None if bias is None else bias.shape}); the head needs "
                         f"({rows}, {columns})")
    return weight, bias


# the labels vLLM gives a reward model's head whatever its config.json says
REWARD_LABELS = {"Qwen2ForRewardModel": 1, "Qwen2ForProcessRewardModel": 2}


def _labels(hf_config: dict, stored: int) -> int:
    """How many labels config.json declares (num_labels, id2label; REWARD_LABELS' for a
    reward model), or the stored projection's rows when it declares none."""
    if architecture_of(hf_config) in REWARD_LABELS:
        return REWARD_LABELS[architecture_of(hf_config)]
    return hf_config.get("num_labels", len(hf_config.get("id2label") or {}) or stored)


# problem_type (transformers' loss of the classifier) -> classify's activation (vLLM's)
PROBLEM_TYPES = {"regression": "identity", "single_label_classification": "classify",
                 "multi_label_classification": "multi_label"}
# a cross-encoder's sentence-transformers activation_fn -> score's activation (vLLM's wraps)
CROSS_ENCODER_FNS = {"torch.nn.modules.linear.Identity": "identity",
                     "torch.nn.modules.activation.Sigmoid": "classify",
                     "torch.nn.modules.activation.Softmax": "classify",
                     "torch.nn.modules.activation.Tanh": "tanh"}


def head_activations(hf_config: dict) -> tuple[str, str]:
    """(classify's, score's) activation as vLLM reads config.json: problem_type for classify;
    for score, the cross-encoder's sentence_transformers.activation_fn (or
    sbert_ce_default_activation_function), else the classify rule; ValueError naming one it
    does not serve."""
    problem = hf_config.get("problem_type") or "single_label_classification"
    if problem not in PROBLEM_TYPES:
        raise ValueError(f"config.json problem_type {problem!r} is not served "
                         f"({', '.join(PROBLEM_TYPES)})")
    function = (hf_config.get("sentence_transformers") or {}).get(
        "activation_fn", hf_config.get("sbert_ce_default_activation_function"))
    if function is not None and function not in CROSS_ENCODER_FNS:
        raise ValueError(f"config.json's cross-encoder activation_fn {function!r} is not "
                         f"served ({', '.join(CROSS_ENCODER_FNS)})")
    return PROBLEM_TYPES[problem], ("classify" if function is None
                                    else CROSS_ENCODER_FNS[function])


def read_head(model_dir: str, hf_config: dict, hidden_size: int) -> ClassifierHead | None:
    """model_dir's classification head (head_layout's tensors), or None for a checkpoint
    without one; hidden_size: the model's (its pooled vectors')."""
    layout = head_layout(hf_config)
    if layout is None:
        return None
    tensors, width, hidden = _Tensors(model_dir), hidden_size, []
    for name, activation, norm_name in layout.hidden:
        weight, bias = _checked(tensors, name, None, width)
        width = weight.shape[0]
        norm = None
        if norm_name is not None:
            scale, shift = tensors.get(f"{norm_name}.weight"), tensors.find(f"{norm_name}.bias")
            if scale.shape != (width,) or (shift is not None and shift.shape != (width,)):
                raise ValueError(f"{model_dir}: {norm_name}.weight has shape {scale.shape}, "
                                 f"the head needs ({width},)")
            norm = (scale, shift, float(hf_config.get("norm_eps", 1e-5)))
        hidden.append(DenseLayer(weight, bias, activation, norm))
    stored = tensors.get(f"{layout.projection}.weight")
    labels = _labels(hf_config, stored.shape[0])
    weight, bias = _checked(tensors, layout.projection, labels, width)
    names = hf_config.get("id2label") or {}
    return ClassifierHead(weight, bias, f"{os.path.basename(model_dir.rstrip('/'))}: "
                          f"{layout.projection}",
                          tuple(str(names.get(str(i), f"LABEL_{i}")) for i in range(labels)),
                          tuple(hidden), *head_activations(hf_config))
