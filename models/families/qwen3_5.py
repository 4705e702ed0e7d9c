"""Qwen3.5 (text: `Qwen3_5ForCausalLM`, and its mixture of experts `Qwen3_5MoeForCausalLM`) and
Qwen3-Next (`Qwen3NextForCausalLM`): hybrid decoders whose `layer_types` put Gated DeltaNet
linear-attention layers (models/layers/gated_deltanet.py; three before every full-attention
layer with `full_attention_interval` 4) beside full attention with a gated output
(`attn_output_gate`), q/k RMSNorm, RoPE on the first quarter of a head
(`partial_rotary_factor` 0.25) and head_dim 256; RMSNorms applied as (1 + weight); the MLPs
dense (Qwen3.5) or experts with a gated shared expert (Qwen3.5-MoE, Qwen3-Next;
models/layers/moe.py). Qwen3.5's multimodal RoPE (mrope) is plain RoPE for text, whose three
position ids are one."""

from __future__ import annotations

import dataclasses

from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.hf_fields import refuse, rope_params
from pagedjax.models.families.llama import (DecoderLayer, LlamaForCausalLM, num_real_tokens,
                                            read_hf_config as read_llama)
from pagedjax.models.families.qwen_moe import sparse_mlp_types
from pagedjax.models.layers.attention import Attention
from pagedjax.models.layers.basic import MLP, rms_norm
from pagedjax.models.layers.gated_deltanet import GatedDeltaNet
from pagedjax.models.layers.moe import SparseMoE

LINEAR_FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                 "linear_value_head_dim", "linear_conv_kernel_dim")


class HybridDecoderLayer(DecoderLayer):
    """Llama's pre-norm layer whose token mixer is full attention (`self_attn`) or, on a
    linear_attention layer, a Gated DeltaNet (`linear_attn`)."""

    def __init__(self, config: LlamaConfig, layer: int = 0, *, rngs: nnx.Rngs, dtype,
                 param_dtype):
        d = config.hidden_size
        self.is_linear = config.layer_is_linear(layer)
        self.input_layernorm = rms_norm(config, d, param_dtype)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, layer, rngs=rngs, dtype=dtype,
                                             param_dtype=param_dtype)
        else:
            self.self_attn = Attention(config, layer, rngs=rngs, dtype=dtype,
                                       param_dtype=param_dtype)
        self.post_attention_layernorm = rms_norm(config, d, param_dtype)
        mlp = SparseMoE if config.layer_is_moe(layer) else MLP
        self.mlp = mlp(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x):
        if not self.is_linear:
            return super().__call__(x)
        x = x + self.linear_attn(self.input_layernorm(x))
        return x + self._mlp(self.post_attention_layernorm(x))


    def forward_paged(self, x, positions, kv_cache, metadata, backend, lora=None):
        """A linear layer reads and writes its rows' states in its state group's blocks
        (models/layers/gated_deltanet.py); a full one is Llama's."""
        if not self.is_linear:
            return super().forward_paged(x, positions, kv_cache, metadata, backend, lora)
        mixed, kv_cache = self.linear_attn.forward_paged(self.input_layernorm(x), kv_cache,
                                                         metadata, backend)
        x = x + mixed
        mlp = self._mlp(self.post_attention_layernorm(x), num_real_tokens(metadata), backend,
                        lora)
        return x + mlp, kv_cache


class Qwen35ForCausalLM(LlamaForCausalLM):
    layer_class = HybridDecoderLayer


def read_hf_config(raw: dict, architecture: str, model_type: str, common: dict) -> LlamaConfig:
    """Qwen3_5TextConfig / Qwen3_5MoeTextConfig / Qwen3NextConfig: `layer_types` (else every
    `full_attention_interval`-th layer full), the linear layers' shapes, partial RoPE; the
    experts as Qwen3-MoE's with Qwen2-MoE's gated shared expert (Qwen3.5-MoE: every layer
    sparse, its routing weights renormalised)."""
    num_layers = common["num_layers"]
    layer_types = raw.get("layer_types")
    if layer_types is None:
        interval = int(raw.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                       for i in range(num_layers)]
    kinds = set(layer_types)
    if not kinds <= {"linear_attention", "full_attention"}:
        raise refuse(architecture, f"layer types {sorted(kinds)}")
    params = rope_params(raw)
    partial = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
                    if isinstance(params, dict) else 0.25)
    if isinstance(params, dict) and params.get("mrope_interleaved") is False:
        raise refuse(architecture, "mrope_interleaved false")
    full = {key: value for key, value in params.items()
            if key not in ("partial_rotary_factor", "mrope_section", "mrope_interleaved")}
    config = read_llama({**raw, "rope_parameters": full, "layer_types": None}, architecture,
                        "qwen3", common)
    linear = {name: int(raw[name]) for name in LINEAR_FIELDS if name in raw}
    config = dataclasses.replace(
        config, model_type=model_type, layer_types=tuple(layer_types), norm_unit_offset=True,
        attention_bias=bool(raw.get("attention_bias", False)), partial_rotary_factor=partial,
        attn_output_gate=bool(raw.get("attn_output_gate", True)),
        linear_fused_projections=model_type == "qwen3_next", **linear)  # type: ignore[arg-type]
    if model_type == "qwen3_5_text":
        return config
    return _with_experts(config, raw, architecture, model_type)


def _with_experts(config: LlamaConfig, raw: dict, architecture: str,
                  model_type: str) -> LlamaConfig:
    num_experts = int(raw.get("num_experts") or 0)
    mlp_types = sparse_mlp_types(raw, config.num_layers, num_experts)
    if "sparse" not in mlp_types:
        raise refuse(architecture, f"no sparse layer (num_experts {num_experts})")
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    return dataclasses.replace(
        config, num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
        moe_intermediate_size=raw.get("moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)) or model_type != "qwen3_next",
        shared_expert_intermediate_size=shared,
        mlp_types=None if "dense" not in mlp_types else mlp_types)
