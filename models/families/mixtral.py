"""Mixtral (`MixtralForCausalLM`): the Llama decoder with a mixture of experts in every layer
(models/layers/moe.py: softmax top-k routing, always renormalised), Mistral's optional sliding window.
Its checkpoints name the MoE block `block_sparse_moe` and an expert's projections w1 (gate),
w3 (up) and w2 (down): MIXTRAL_NAMES maps the generic names to them."""

from __future__ import annotations

import dataclasses

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import read_hf_config as read_llama

MIXTRAL_NAMES = ((".mlp.", ".block_sparse_moe."), (".gate_proj.", ".w1."),
                 (".up_proj.", ".w3."), (".down_proj.", ".w2."))


def read_hf_config(raw: dict, architecture: str, model_type: str, common: dict) -> LlamaConfig:
    config = read_llama(raw, architecture, "mistral", common)
    return dataclasses.replace(
        config, model_type=model_type, num_experts=int(raw.get("num_local_experts", 8)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)), norm_topk_prob=True)
