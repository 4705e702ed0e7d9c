"""A LlamaConfig's parameter count (config.num_params, num_active_params): every family's
projections, norms, experts and embeddings, as the modules hold them."""

from __future__ import annotations


def num_params(config, experts: int) -> int:
    d, h = config.hidden_size, config.head_dim
    query = config.num_heads * (2 if config.attn_output_gate else 1)
    attn = (mla_params(config) if config.kv_lora_rank else
            d * h * (query + config.num_heads + 2 * config.num_kv_heads))
    if not config.kv_lora_rank:
        attn += (config.num_heads + 2 * config.num_kv_heads) * h * config.attention_bias
    attn += d * config.o_proj_bias
    attn += (config.num_heads + config.num_kv_heads) * h if config.qk_norm_whole else (
        2 * h * config.qk_norm)
    attn += config.num_heads * config.attention_sinks
    dense = 3 * d * config.intermediate_size + (2 * config.intermediate_size + d) * config.mlp_bias
    shared = config.shared_expert_intermediate_size
    f = config.expert_intermediate_size
    expert_biases = (2 * f + d) if config.expert_layout == "interleaved" else 0
    router = d + config.router_bias + (config.topk_method == "noaux_tc")  # + correction bias
    shared_params = 3 * d * shared + d * config.shared_expert_gate if shared else 0
    sparse = (router * config.num_experts + experts * (3 * d * f + expert_biases)
              + shared_params)
    sparse_layers = config.num_sparse_layers
    mlps = sparse_layers * sparse + (config.num_layers - sparse_layers) * dense
    embed = config.vocab_size * d * (1 if config.tie_word_embeddings else 2)
    norms = (4 if config.sandwich_norms else 2) * d
    linear = config.num_layers - config.num_attention_layers
    return (config.num_attention_layers * attn + linear * linear_params(config)
            + config.num_layers * norms + mlps + embed + d)

def mla_params(config) -> int:
    """A latent attention layer's projections and norms (o_proj's bias: o_proj_bias)."""
    d, n, latent = config.hidden_size, config.num_heads, config.kv_lora_rank
    query = n * config.head_dim
    bias = config.attention_bias
    q = (d * query if config.q_lora_rank is None else
         (d + bias + 1) * config.q_lora_rank + config.q_lora_rank * query)
    kv = (d + bias) * (latent + config.qk_rope_head_dim) + latent
    return q + kv + latent * n * (config.qk_nope_head_dim + config.v_head_dim) + (
        n * config.v_head_dim * d)

def linear_params(config) -> int:
    """A Gated DeltaNet layer's: in_proj q/k/v, z, b, a, the conv, dt_bias, A_log, the
    gated norm, out_proj."""
    hv, value = config.linear_num_value_heads, (
        config.linear_num_value_heads * config.linear_value_head_dim)
    conv = config.linear_conv_dim
    return (config.hidden_size * (conv + value + 2 * hv) + conv * config.linear_conv_kernel_dim
            + 2 * hv + config.linear_value_head_dim + value * config.hidden_size)
