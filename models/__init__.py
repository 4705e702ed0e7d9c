"""Flax NNX models served by the engine, installed as pagedjax.models. The rooms: config and
registry (architectures -> family) here, families/ (one module a family), layers/ (what the
families are built from), loading/ (weights in), quantization/, training/, and paged_forward
(the form the engine runs: layers stacked under lax.scan over the paged KV cache)."""

import os

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import LlamaForCausalLM
from pagedjax.models.named_configs import CONFIGS, get_config
from pagedjax.models.paged_forward import ServingGraph, ServingWeights, serving_form
from pagedjax.models.registry import init_model

# The project's trained byte-level model (models/training/train.py), shipped in the repository.
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(__file__), "checkpoints", "pagedjax-tiny")

__all__ = ["DEFAULT_CHECKPOINT", "CONFIGS", "LlamaConfig", "get_config", "LlamaForCausalLM", "init_model",
           "ServingGraph", "ServingWeights", "serving_form"]
