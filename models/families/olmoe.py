"""OLMoE (`OlmoeForCausalLM`): the Llama decoder with a mixture of experts in every layer
(models/layers/moe.py, experts intermediate_size wide, `norm_topk_prob` as configured), q/k RMSNorm
over the whole projection (not a head) and, when `clip_qkv` is set, q, k and v clamped."""

from __future__ import annotations

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.hf_fields import rope_from_params, rope_params


def read_hf_config(raw: dict, architecture: str, model_type: str, common: dict) -> LlamaConfig:
    theta, scaling = rope_from_params(rope_params(raw), architecture)
    bias = bool(raw.get("attention_bias", False))
    return LlamaConfig(
        **common, rope_theta=theta, rope_scaling=scaling, attention_bias=bias, o_proj_bias=bias,
        qk_norm=True, qk_norm_whole=True, clip_qkv=raw.get("clip_qkv"), model_type=model_type,
        num_experts=int(raw.get("num_experts") or raw.get("num_local_experts") or 64),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 8)),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)))
