"""A Llama-family decoder in Flax NNX with two paths over the same weights.

- `__call__(token_ids)`: dense causal forward over [B, L] tokens (training, and the reference).
- `forward_paged(kv_cache, token_ids, positions, metadata)`: the serving path over a flat [T]
  batch of tokens from many sequences, reading and writing the paged KV cache; it returns
  `(hidden, new_kv_cache)` and `logits(hidden)` projects only the rows that are sampled. Its
  layers are unrolled; the engine runs pagedjax.models.paged_forward's form of the same weights, stacked and
  scanned, which traces one layer whatever the depth.

Axis letters: B batch, L sequence length, T flat tokens, D model dim, N query heads, K KV heads,
G = N // K, H head dim, F MLP dim, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.families.hf_fields import refuse, rope_from_params, rope_params
from pagedjax.models.layers.attention import Attention, soft_cap
from pagedjax.models.layers.basic import (MLP, RMSNorm, linear, rms_norm, rope,  # noqa: F401
                                          rope_inv_freq)
from pagedjax.models.layers.lora import LayerLoRA
from pagedjax.models.layers.mla import LatentAttention
from pagedjax.models.layers.moe import SparseMoE
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, for_layer


class DecoderLayer(nnx.Module):
    """Pre-norm attention and MLP (dense, or a mixture of experts: models/layers/moe.py), each added
    to the residual stream."""

    def __init__(self, config: LlamaConfig, layer: int = 0, *, rngs: nnx.Rngs, dtype,
                 param_dtype):
        d = config.hidden_size
        self.input_layernorm = rms_norm(config, d, param_dtype)
        attention = LatentAttention if config.kv_lora_rank else Attention  # DeepSeek's MLA
        self.self_attn = attention(config, layer, rngs=rngs, dtype=dtype,
                                   param_dtype=param_dtype)
        self.post_attention_layernorm = rms_norm(config, d, param_dtype)
        mlp = SparseMoE if config.layer_is_moe(layer) else MLP
        self.mlp = mlp(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def _mlp(self, x: jax.Array, num_valid: jax.Array | None = None,
             backend: AttentionBackend | None = None, lora: LayerLoRA | None = None) -> jax.Array:
        """The MLP on x (a dense one adapted by lora); an MoE layer routes only the first
        num_valid tokens (a BatchPlan's real ones) to its experts, split over the backend's
        mesh (whole experts a device under expert parallelism, else each expert's MLP)."""
        if isinstance(self.mlp, SparseMoE):
            if backend is None or backend.mesh is None:
                return self.mlp(x, num_valid)
            return self.mlp(x, num_valid, backend.mesh, backend.expert_parallel)
        return self.mlp(x, lora)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self._mlp(self.post_attention_layernorm(x))

    def forward_paged(self, x, positions, kv_cache, metadata, backend, lora=None):
        """lora: the step's adapters of this layer (models/layers/lora.py) or None."""
        attn, kv_cache = self.self_attn.forward_paged(self.input_layernorm(x), positions,
                                                      kv_cache, metadata, backend, lora)
        x = x + attn
        mlp = self._mlp(self.post_attention_layernorm(x), num_real_tokens(metadata), backend,
                        lora)
        return x + mlp, kv_cache


def num_real_tokens(metadata: AttentionMetadata) -> jax.Array:
    """The plan's real query tokens (the rest pad T)."""
    return metadata.cu_q_lens[metadata.num_seqs]


class LlamaForCausalLM(nnx.Module):
    """The decoder: embeddings, layers (layer_class, one per layer), final norm, vocabulary
    projection (tied to the embeddings without lm_head). A family with other layers subclasses
    it (models/families/gemma.py), so everything that serves a model takes either."""

    layer_class = DecoderLayer

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)
        self.layers = nnx.List([self.layer_class(config, index, rngs=rngs, dtype=dtype,
                                                 param_dtype=param_dtype)
                                for index in range(config.num_layers)])
        self.norm = rms_norm(config, config.hidden_size, param_dtype)
        self.lm_head = (None if config.tie_word_embeddings else
                        linear(config.hidden_size, config.vocab_size, config, rngs, dtype,
                               param_dtype))

    def logits(self, hidden: jax.Array) -> jax.Array:  # [..., D] -> f32[..., V]
        return project_logits(self.norm, self.embed_tokens, self.lm_head, hidden,
                              self.config.final_logit_softcapping)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        return embed(self.embed_tokens, token_ids, self.config.scale_embeddings)

    def __call__(self, token_ids: jax.Array) -> jax.Array:  # i32[B, L] -> f32[B, L, V]
        x = self.embed(token_ids)
        for layer in self.layers:
            x = layer(x)
        return self.logits(x)

    def forward_paged(
        self,
        kv_cache: jax.Array,  # [2, K, L * NB, S, Hc]: every layer (pallas_kernels.layout)
        token_ids: jax.Array,  # i32[T]
        positions: jax.Array,  # i32[T]
        metadata: AttentionMetadata,
        backend: AttentionBackend = AttentionBackend(),
    ) -> tuple[jax.Array, jax.Array]:  # ([T, D] pre-norm hidden, new cache)
        """The layers unrolled in Python (one copy of the layer per layer in a traced program):
        the reference for pagedjax.models.paged_forward's scanned form."""
        x = self.embed(token_ids)
        blocks_per_layer = kv_cache.shape[2] // len(self.layers)
        block_size = kv_cache.shape[3]
        for index, layer in enumerate(self.layers):
            x, kv_cache = layer.forward_paged(
                x, positions, kv_cache, for_layer(metadata, index, blocks_per_layer, block_size),
                backend)
        return x, kv_cache


def embed(embed_tokens: nnx.Embed, token_ids: jax.Array, scale: bool) -> jax.Array:
    """The token embeddings, times sqrt(D) in their dtype when scale (Gemma's)."""
    x = embed_tokens(token_ids)
    if scale:
        x = x * jnp.asarray(embed_tokens.features ** 0.5, x.dtype)
    return x


def project_logits(norm: RMSNorm, embed_tokens: nnx.Embed, lm_head: nnx.Linear | None,
                   hidden: jax.Array, cap: float | None = None) -> jax.Array:
    """The final norm, the vocabulary projection (the tied embedding when lm_head is None) and
    the final logit soft-capping when cap is set (Gemma 2). [..., D] -> f32[..., V]."""
    hidden = norm(hidden)
    if lm_head is None:
        return soft_cap(embed_tokens.attend(hidden).astype(jnp.float32), cap)
    return soft_cap(lm_head(hidden).astype(jnp.float32), cap)


def read_hf_config(raw: dict, architecture: str, model_type: str, common: dict) -> LlamaConfig:
    """The Llama family's config.json (Llama 2/3/3.1, Mistral, Qwen2, Qwen3). Qwen2/3 give
    layer_types (or use_sliding_window with max_window_layers in the transformers 4 format:
    the layers from max_window_layers on slide), a mix of sliding and full layers running on
    KV cache groups; Mistral gives sliding_window alone, for every layer."""
    theta, scaling = rope_from_params(rope_params(raw), architecture)
    window = raw.get("sliding_window")
    num_layers = common["num_layers"]
    mixed = None
    if model_type in ("qwen2", "qwen3"):
        layer_types = raw.get("layer_types")
        if layer_types is None:
            sliding = raw.get("use_sliding_window", False)
            first = raw.get("max_window_layers", num_layers)
            layer_types = ["sliding_attention" if sliding and i >= first else "full_attention"
                           for i in range(num_layers)]
        kinds = set(layer_types)
        if not kinds <= {"full_attention", "sliding_attention"}:
            raise refuse(architecture, f"layer types {sorted(kinds)}")
        if len(kinds) > 1:
            mixed = tuple(layer_types)
        elif kinds != {"sliding_attention"}:
            window = None
    elif model_type == "llama":
        window = None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window must be an integer >= 1, got {window!r}")
    bias = bool(raw.get("attention_bias", False))
    if mixed and window is None:
        raise ValueError("layer_types has sliding_attention layers but no sliding_window")
    return LlamaConfig(**common, rope_theta=theta, rope_scaling=scaling, sliding_window=window,
                       layer_types=mixed, attention_bias=bias or model_type == "qwen2",
                       o_proj_bias=bias and model_type == "llama",
                       mlp_bias=bool(raw.get("mlp_bias", False)),
                       qk_norm=model_type == "qwen3", model_type=model_type)
