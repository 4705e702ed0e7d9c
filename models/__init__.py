"""Flax NNX models served by the engine: config, the Llama family, weight loading."""

import os

from pagedjax.models.config import CONFIGS, LlamaConfig, get_config
from pagedjax.models.llama import LlamaForCausalLM, init_model
from pagedjax.models.serving import ServingGraph, ServingWeights, serving_form

# The project's trained byte-level model (models/train.py), shipped in the repository.
DEFAULT_CHECKPOINT = os.path.join(os.path.dirname(__file__), "checkpoints", "pagedjax-tiny")

__all__ = ["DEFAULT_CHECKPOINT", "CONFIGS", "LlamaConfig", "get_config", "LlamaForCausalLM", "init_model",
           "ServingGraph", "ServingWeights", "serving_form"]
