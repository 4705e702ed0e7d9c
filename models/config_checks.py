"""The family fields' checks of a LlamaConfig (models/config.py calls them from __post_init__,
each taking the config): multi-head latent attention, DeepSeek's routing, linear
attention. Every refusal names the field and the limit."""

from __future__ import annotations

import math

# DeepSeek's routers (models/layers/grouped_routing.py): V2's softmax greedy or group
# limited, V3's sigmoid with a correction bias
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def check_mla_fields(config) -> None:
    for name in ("kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 with multi-head latent "
                             f"attention (kv_lora_rank > 0), got {value!r}")
    if config.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be even for RoPE, "
                         f"got {config.qk_rope_head_dim}")
    if config.head_dim != config.qk_nope_head_dim + config.qk_rope_head_dim:
        raise ValueError(f"head_dim ({config.head_dim}) must be qk_nope_head_dim + "
                         f"qk_rope_head_dim ({config.qk_nope_head_dim} + "
                         f"{config.qk_rope_head_dim}) with multi-head latent attention")
    if config.q_lora_rank is not None and (not isinstance(config.q_lora_rank, int)
                                         or config.q_lora_rank < 1):
        raise ValueError(f"q_lora_rank must be None or an integer >= 1, "
                         f"got {config.q_lora_rank!r}")
    if config.layer_types is not None or config.sliding_window is not None:
        raise ValueError("multi-head latent attention layers are full attention: "
                         "layer_types and sliding_window must be None")

def check_grouped_routing(config) -> None:
    if config.topk_method not in TOPK_METHODS:
        raise ValueError(f"topk_method must be None or one of {TOPK_METHODS}, "
                         f"got {config.topk_method!r}")
    groups, kept = config.n_group, config.topk_group
    if not (isinstance(groups, int) and isinstance(kept, int) and 1 <= kept <= groups):
        raise ValueError(f"routing needs integers 1 <= topk_group ({kept!r}) <= n_group "
                         f"({groups!r})")
    if not (isinstance(config.routed_scaling_factor, (int, float))
            and math.isfinite(config.routed_scaling_factor)
            and config.routed_scaling_factor > 0):
        raise ValueError(f"routed_scaling_factor must be a finite number > 0, "
                         f"got {config.routed_scaling_factor!r}")
    if config.num_experts % groups:
        raise ValueError(f"n_group ({groups}) must divide num_experts ({config.num_experts})")
    if config.num_experts_per_tok > kept * (config.num_experts // groups):
        raise ValueError(f"num_experts_per_tok ({config.num_experts_per_tok}) exceeds the "
                         f"experts of the topk_group ({kept}) groups kept")

def check_linear_fields(config) -> None:
    for name in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1 with linear_attention "
                             f"layers, got {value!r}")
    if config.linear_num_value_heads % config.linear_num_key_heads:
        raise ValueError(f"linear_num_value_heads ({config.linear_num_value_heads}) must be "
                         f"divisible by linear_num_key_heads ({config.linear_num_key_heads})")
