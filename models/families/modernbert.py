"""ModernBERT (transformers' ModernBertModel): a bidirectional encoder with rotary positions,
pre-norm layers (LayerNorm without bias by default; none before the first layer's attention),
a GeGLU MLP, and attention alternating between global layers and local ones (a window of
local_attention // 2 tokens either side), each kind with its own RoPE theta. Dense only, as
BERT (models.families.bert says why); the engine pads and batches it the same way.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.models.families.bert import ACTIVATIONS


@dataclasses.dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    max_position_embeddings: int
    layer_types: tuple[str, ...]  # "full_attention" or "sliding_attention" each layer
    rope_thetas: tuple[float, float]  # (global layers', local layers')
    half_window: int  # a local layer's token attends within this distance
    norm_eps: float = 1e-5
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "gelu"
    model_type: str = "modernbert"

    @property
    def max_tokens(self) -> int:
        return self.max_position_embeddings


def read_modernbert_config(raw: dict) -> ModernBertConfig:
    """config.json in transformers' current form (layer_types, rope_parameters) or the
    checkpoints' original one (global_attn_every_n_layers, global / local_rope_theta)."""
    layers = raw["num_hidden_layers"]
    every = raw.get("global_attn_every_n_layers", 3)
    types = tuple(raw.get("layer_types") or (
        "full_attention" if i % every == 0 else "sliding_attention" for i in range(layers)))
    rope = raw.get("rope_parameters") or {}
    thetas = (rope.get("full_attention", {}).get("rope_theta", raw.get("global_rope_theta",
                                                                        160000.0)),
              rope.get("sliding_attention", {}).get("rope_theta", raw.get("local_rope_theta",
                                                                           10000.0)))
    for kind, params in rope.items():
        if params and params.get("rope_type", "default") != "default":
            raise ValueError(f"modernbert: {kind} rope_type {params['rope_type']!r} is not "
                             "served (default only)")
    act = raw.get("hidden_activation", "gelu")
    if act not in ACTIVATIONS:
        raise ValueError(f"modernbert: hidden_activation {act!r} is not served")
    return ModernBertConfig(raw["vocab_size"], raw["hidden_size"], raw["intermediate_size"],
                            layers, raw["num_attention_heads"], raw["max_position_embeddings"],
                            types, (float(thetas[0]), float(thetas[1])),
                            raw.get("local_attention", 128) // 2, raw.get("norm_eps", 1e-5),
                            raw.get("norm_bias", False), raw.get("attention_bias", False),
                            raw.get("mlp_bias", False), act)


def rotary(x: jax.Array, theta: float) -> jax.Array:
    """x [B, L, N, H] rotated by position (the halves convention: x * cos + rotate_half * sin)."""
    head_dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(x.shape[1], dtype=jnp.float32)[:, None] * inv_freq[None]  # [L, H/2]
    cos = jnp.cos(jnp.concatenate([angles, angles], -1))[None, :, None]
    sin = jnp.sin(jnp.concatenate([angles, angles], -1))[None, :, None]
    half = head_dim // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rotated * sin).astype(x.dtype)


class ModernBertLayer(nnx.Module):
    def __init__(self, config: ModernBertConfig, index: int, *, rngs: nnx.Rngs):
        d, f = config.hidden_size, config.intermediate_size
        norm = lambda: nnx.LayerNorm(d, epsilon=config.norm_eps,  # noqa: E731
                                     use_bias=config.norm_bias, rngs=rngs)
        self.config, self.index = config, index
        self.attn_norm = norm() if index else None
        self.wqkv = nnx.Linear(d, 3 * d, use_bias=config.attention_bias, rngs=rngs)
        self.wo = nnx.Linear(d, d, use_bias=config.attention_bias, rngs=rngs)
        self.mlp_norm = norm()
        self.wi = nnx.Linear(d, 2 * f, use_bias=config.mlp_bias, rngs=rngs)
        self.mlp_out = nnx.Linear(f, d, use_bias=config.mlp_bias, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        """x [B, L, D], mask bool[B, L] (the real tokens)."""
        config = self.config
        b, length, d = x.shape
        local = config.layer_types[self.index] == "sliding_attention"
        h = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = jnp.split(self.wqkv(h).reshape(b, length, 3, config.num_heads, -1), 3, 2)
        theta = config.rope_thetas[1 if local else 0]
        q, k, v = rotary(q[:, :, 0], theta), rotary(k[:, :, 0], theta), v[:, :, 0]
        scores = jnp.einsum("BLNH,BMNH->BNLM", q, k) / jnp.sqrt(jnp.float32(q.shape[-1]))
        allowed = jnp.broadcast_to(mask[:, None, :], (b, length, length))
        if local:
            positions = jnp.arange(length)
            allowed &= jnp.abs(positions[:, None] - positions[None, :]) <= config.half_window
        # finite: a padding query far from every real token (a local layer) gets some
        # finite row, never NaN that its values would carry into the real rows
        scores = jnp.where(allowed[:, None], scores, -1e30)
        context = jnp.einsum("BNLM,BMNH->BLNH", jax.nn.softmax(scores, axis=-1), v)
        x = x + self.wo(context.reshape(b, length, d))
        gate_in, gate = jnp.split(self.wi(self.mlp_norm(x)), 2, axis=-1)
        return x + self.mlp_out(ACTIVATIONS[config.hidden_act](gate_in) * gate)


class ModernBertModel(nnx.Module):
    """last_hidden_state of transformers' ModernBertModel (after its final norm)."""

    def __init__(self, config: ModernBertConfig, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.config = config
        self.tok_embeddings = nnx.Embed(config.vocab_size, d, rngs=rngs)
        self.embedding_norm = nnx.LayerNorm(d, epsilon=config.norm_eps,
                                            use_bias=config.norm_bias, rngs=rngs)
        self.layers = nnx.List([ModernBertLayer(config, i, rngs=rngs)
                                for i in range(config.num_layers)])
        self.final_norm = nnx.LayerNorm(d, epsilon=config.norm_eps, use_bias=config.norm_bias,
                                        rngs=rngs)

    def __call__(self, token_ids: jax.Array, mask: jax.Array) -> jax.Array:
        x = self.embedding_norm(self.tok_embeddings(token_ids))
        for layer in self.layers:
            x = layer(x, mask)
        return self.final_norm(x)
