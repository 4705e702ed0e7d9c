"""gpt-oss (`GptOssForCausalLM`): the Llama decoder with attention sinks (a learned logit a head
joining every softmax, models/layers/attention.py), q/k/v/o biases, sliding-window (128 tokens)
and full layers alternating (`layer_types`, served on KV cache groups), YaRN RoPE, and a mixture
of experts in every layer: a router with a bias, softmax over its top-k logits, and experts in the
fused layout (models/layers/moe.InterleavedExperts: gate_up_proj with gate and up interleaved,
biases, the clamped SwiGLU of swiglu_alpha and swiglu_limit).

Its checkpoints store the experts fused, [E, in, out] as the module holds them
(`mlp.experts.gate_up_proj`, `..._bias`, `mlp.experts.down_proj`, `..._bias`) and the router as
`mlp.router`: GPT_OSS_NAMES maps the generic names to them."""

from __future__ import annotations

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.hf_fields import refuse, rope_from_params, rope_params

GPT_OSS_NAMES = tuple(
    (f".experts.{{expert}}.{leaf}.weight", f".experts.{leaf}")
    for leaf in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
) + ((".mlp.gate.", ".mlp.router."),)


def read_hf_config(raw: dict, architecture: str, model_type: str, common: dict) -> LlamaConfig:
    theta, scaling = rope_from_params(rope_params(raw), architecture)
    num_layers = common["num_layers"]
    layer_types = raw.get("layer_types") or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    kinds = set(layer_types)
    if not kinds <= {"full_attention", "sliding_attention"}:
        raise refuse(architecture, f"layer types {sorted(kinds)}")
    window = raw.get("sliding_window")
    if "sliding_attention" not in kinds:
        window = None
    elif not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be an integer >= 1, got {window!r}")
    bias = bool(raw.get("attention_bias", True))
    num_experts = int(raw.get("num_local_experts") or 0)
    if num_experts < 1:
        raise ValueError(f"{architecture} needs num_local_experts >= 1, got {num_experts}")
    return LlamaConfig(
        **common, rope_theta=theta, rope_scaling=scaling, sliding_window=window,
        layer_types=tuple(layer_types) if len(kinds) > 1 else None,
        attention_bias=bias, o_proj_bias=bias, model_type=model_type, attention_sinks=True,
        num_experts=num_experts, num_experts_per_tok=int(raw.get("num_experts_per_tok", 4)),
        norm_topk_prob=True, router_bias=True, expert_layout="interleaved",
        swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)))
