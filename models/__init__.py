"""Flax NNX models served by the engine: config, the Llama family, weight loading."""

from models.config import CONFIGS, LlamaConfig, get_config
from models.llama import LlamaForCausalLM, init_model

__all__ = ["CONFIGS", "LlamaConfig", "get_config", "LlamaForCausalLM", "init_model"]
