"""Qwen2-MoE and Qwen3-MoE (`Qwen2MoeForCausalLM`, `Qwen3MoeForCausalLM`): Qwen2's / Qwen3's
attention with mixture-of-experts MLPs (models/layers/moe.py). A layer is sparse unless it is in
`mlp_only_layers` or off the `decoder_sparse_step` (then a dense MLP of intermediate_size);
experts are moe_intermediate_size wide; `norm_topk_prob` renormalises the routing weights or
not; Qwen2-MoE adds a shared expert every token takes, gated by sigmoid(x @ W)."""

from __future__ import annotations

import dataclasses

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.llama import read_hf_config as read_llama


def read_hf_config(raw: dict, architecture: str, model_type: str, common: dict) -> LlamaConfig:
    base = "qwen2" if model_type == "qwen2_moe" else "qwen3"
    config = read_llama(raw, architecture, base, common)
    if model_type == "qwen2_moe":  # q/k/v biases: transformers 5's qkv_bias (4: always)
        config = dataclasses.replace(config, attention_bias=bool(raw.get("qkv_bias", True)))
    # (transformers 5 writes num_experts as num_local_experts for Qwen3-MoE)
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    mlp_types = sparse_mlp_types(raw, config.num_layers, num_experts)
    if not num_experts or "sparse" not in mlp_types:
        dense_layers = sorted(raw.get("mlp_only_layers") or ())
        raise ValueError(f"{architecture} with no sparse layer (num_experts {num_experts}, "
                         f"mlp_only_layers {dense_layers}): serve it as "
                         f"{'Qwen2' if base == 'qwen2' else 'Qwen3'}ForCausalLM")
    return dataclasses.replace(
        config, model_type=model_type, num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
        moe_intermediate_size=raw.get("moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", model_type == "qwen3_moe")),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if model_type == "qwen2_moe" else 0,
        mlp_types=None if "dense" not in mlp_types else mlp_types)


def sparse_mlp_types(raw: dict, num_layers: int, num_experts: int) -> tuple[str, ...]:
    """Each layer's MLP, "sparse" or "dense": sparse unless in `mlp_only_layers` or off the
    `decoder_sparse_step` (or the model has no experts)."""
    step = int(raw.get("decoder_sparse_step", 1))
    dense_layers = set(raw.get("mlp_only_layers") or ())
    if step < 1:
        raise ValueError(f"decoder_sparse_step must be >= 1, got {step}")
    return tuple("sparse" if num_experts and i not in dense_layers and (i + 1) % step == 0
                 else "dense" for i in range(num_layers))
