"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's switches (models.config):
GeGLU MLP (tanh GELU), RMSNorm applied as (1 + weight), embeddings scaled by sqrt(hidden), four
norms a layer (before and after attention and the MLP), the attention scale from
query_pre_attn_scalar, attention and final logit soft-capping (Gemma 2), q/k RMSNorm and a local
RoPE base for the sliding layers (Gemma 3), and the per-layer pattern of sliding-window and
global layers (config.layer_types)."""

from __future__ import annotations

import jax
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.hf_fields import refuse, rope_from_params, rope_params
from pagedjax.models.families.llama import DecoderLayer, LlamaForCausalLM
from pagedjax.models.layers.basic import rms_norm


class GemmaDecoderLayer(DecoderLayer):
    """x + post_attn_norm(attn(input_norm(x))), then the same around the MLP: Llama's layer
    (its post_attention_layernorm here normalizes the attention's output) with two more norms."""

    def __init__(self, config: LlamaConfig, layer: int = 0, *, rngs: nnx.Rngs, dtype,
                 param_dtype):
        super().__init__(config, layer, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.pre_feedforward_layernorm = rms_norm(config, config.hidden_size, param_dtype)
        self.post_feedforward_layernorm = rms_norm(config, config.hidden_size, param_dtype)

    def _feed_forward(self, x: jax.Array, lora=None) -> jax.Array:
        return x + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(x), lora))

    def __call__(self, x: jax.Array) -> jax.Array:
        return self._feed_forward(x + self.post_attention_layernorm(self.self_attn(
            self.input_layernorm(x))))

    def forward_paged(self, x, positions, kv_cache, metadata, backend, lora=None):
        attn, kv_cache = self.self_attn.forward_paged(self.input_layernorm(x), positions,
                                                      kv_cache, metadata, backend, lora)
        return self._feed_forward(x + self.post_attention_layernorm(attn), lora), kv_cache


class GemmaForCausalLM(LlamaForCausalLM):
    layer_class = GemmaDecoderLayer


def read_hf_config(raw: dict, architecture: str, model_type: str, common: dict) -> LlamaConfig:
    """Gemma2Config / Gemma3TextConfig: the layer pattern from `layer_types`, else from
    `sliding_window_pattern` (Gemma 3: every Nth layer global) or alternation (Gemma 2: even
    layers sliding); Gemma 3's RoPE per layer type (transformers 5's rope_parameters by layer
    type, or rope_theta + rope_scaling for the global layers and rope_local_base_freq)."""
    num_layers = common["num_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:
        period = raw.get("sliding_window_pattern", 2)
        layer_types = ["full_attention" if (i + 1) % period == 0 else "sliding_attention"
                       for i in range(num_layers)]
    params = rope_params(raw)
    local_theta = None
    if isinstance(params, dict) and "full_attention" in params:  # by layer type
        theta, scaling = rope_from_params(params["full_attention"], architecture)
        local_theta, local_scaling = rope_from_params(params.get("sliding_attention"),
                                                      architecture)
        if local_scaling is not None:
            raise refuse(architecture, "RoPE scaling on the sliding layers")
    else:
        theta, scaling = rope_from_params(params, architecture)
        if model_type == "gemma3_text":
            local_theta = float(raw.get("rope_local_base_freq", 10000.0))
    if raw.get("use_bidirectional_attention"):
        raise refuse(architecture, "bidirectional attention (EmbeddingGemma)")
    return LlamaConfig(
        **common, rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
        sliding_window=raw.get("sliding_window"), layer_types=tuple(layer_types),
        attention_bias=bool(raw.get("attention_bias", False)),
        o_proj_bias=bool(raw.get("attention_bias", False)), qk_norm=model_type == "gemma3_text",
        hidden_act="gelu_pytorch_tanh", norm_unit_offset=True, scale_embeddings=True,
        sandwich_norms=True, query_pre_attn_scalar=raw.get("query_pre_attn_scalar"),
        attn_logit_softcapping=raw.get("attn_logit_softcapping"),
        final_logit_softcapping=raw.get("final_logit_softcapping"), model_type=model_type)
