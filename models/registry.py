"""The model registry: each supported Hugging Face architecture (config.json `architectures`)
and GGUF `general.architecture`, mapped to its family: the model class (models/families/<family>.py),
the family's config.json reader, the activations its MLP knows, and the model_type its configs
carry. Adding a family is its module and a line here (the families never import this
table: it imports them); `pagedjax inspect` and the refusal of an
unknown architecture list this table."""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
from flax import nnx

from pagedjax.models.families import (deepseek, gemma, gpt_oss, llama, mixtral, olmoe, qwen3_5,
                                      qwen_moe)


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    model_class: type  # a LlamaForCausalLM (or subclass) built from a LlamaConfig
    read_config: Callable  # (config.json dict, architecture, model_type, common fields) -> config
    model_types: dict  # architecture -> the model_type its config.json carries
    hidden_acts: tuple[str, ...] = ("silu",)
    # substitutions turning the generic checkpoint names (pagedjax.models.loading.hf.hf_weight_name) into the family's
    hf_renames: tuple[tuple[str, str], ...] = ()


LLAMA = Family("llama", llama.LlamaForCausalLM, llama.read_hf_config,
               {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"})
GEMMA = Family("gemma", gemma.GemmaForCausalLM, gemma.read_hf_config,
               {"Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3_text"},
               hidden_acts=("gelu_pytorch_tanh",))
# Mixtures of experts (models/layers/moe.py): the Llama decoder with expert MLPs.
MIXTRAL = Family("mixtral", llama.LlamaForCausalLM, mixtral.read_hf_config,
                 {"MixtralForCausalLM": "mixtral"}, hf_renames=mixtral.MIXTRAL_NAMES)
QWEN_MOE = Family("qwen_moe", llama.LlamaForCausalLM, qwen_moe.read_hf_config,
                  {"Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"})
OLMOE = Family("olmoe", llama.LlamaForCausalLM, olmoe.read_hf_config,
               {"OlmoeForCausalLM": "olmoe"})
# Hybrid linear attention (models/families/qwen3_5.py): Gated DeltaNet layers beside full ones.
QWEN3_5 = Family("qwen3_5", qwen3_5.Qwen35ForCausalLM, qwen3_5.read_hf_config,
                 {"Qwen3_5ForCausalLM": "qwen3_5_text",
                  "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
                  "Qwen3NextForCausalLM": "qwen3_next"})
# Attention sinks, biased experts in a fused layout (models/families/gpt_oss.py).
GPT_OSS = Family("gpt_oss", llama.LlamaForCausalLM, gpt_oss.read_hf_config,
                 {"GptOssForCausalLM": "gpt_oss"}, hf_renames=gpt_oss.GPT_OSS_NAMES)
# Multi-head latent attention, grouped routing, shared experts (models/families/deepseek.py).
DEEPSEEK = Family("deepseek", llama.LlamaForCausalLM, deepseek.read_hf_config,
                  {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"},
                  hf_renames=deepseek.DEEPSEEK_NAMES)
FAMILIES = (LLAMA, GEMMA, MIXTRAL, QWEN_MOE, OLMOE, QWEN3_5, GPT_OSS, DEEPSEEK)
ARCHITECTURES = {arch: family for family in FAMILIES for arch in family.model_types}
# GGUF general.architecture -> family (llama.cpp writes Mistral and Llama 3 as `llama`).
GGUF_ARCHITECTURES = {"llama": LLAMA}
MODEL_TYPES = {model_type: family for family in FAMILIES
               for model_type in family.model_types.values()}


def model_class(config) -> type:
    """The class that builds a model of this config (by its model_type; Llama's otherwise)."""
    return MODEL_TYPES.get(config.model_type, LLAMA).model_class


def init_model(config, seed: int = 0, dtype=jnp.float32, param_dtype=jnp.float32):
    """A randomly initialised model of the config's family, deterministic in seed."""
    return model_class(config)(config, rngs=nnx.Rngs(seed), dtype=dtype,
                               param_dtype=param_dtype)


def hf_renames(config) -> tuple[tuple[str, str], ...]:
    """The checkpoint-name substitutions of the config's family (Family.hf_renames)."""
    return MODEL_TYPES.get(config.model_type, LLAMA).hf_renames


def table() -> list[dict]:
    """The registry as `pagedjax inspect --list` prints it."""
    rows = [{"architecture": arch, "family": family.name, "model_type": model_type,
             "format": "hf"} for family in FAMILIES
            for arch, model_type in family.model_types.items()]
    return rows + [{"architecture": arch, "family": family.name, "model_type": arch,
                    "format": "gguf"} for arch, family in GGUF_ARCHITECTURES.items()]
