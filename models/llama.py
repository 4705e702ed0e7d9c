"""A Llama-family decoder in Flax NNX with two paths over the same weights.

- `__call__(token_ids)`: dense causal forward over [B, L] tokens (training, and the reference).
- `forward_paged(kv_cache, token_ids, positions, metadata)`: the serving path over a flat [T]
  batch of tokens from many sequences, reading and writing the paged KV cache; it returns
  `(hidden, new_kv_cache)` and `logits(hidden)` projects only the rows that are sampled. Its
  layers are unrolled; the engine runs models.serving's form of the same weights, stacked and
  scanned, which traces one layer whatever the depth.

Axis letters: B batch, L sequence length, T flat tokens, D model dim, N query heads, K KV heads,
G = N // K, H head dim, F MLP dim, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import LlamaConfig, RopeScaling
from pallas_kernels import AttentionBackend, AttentionMetadata, for_layer, paged_attention


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float,
                  scaling: RopeScaling | None = None) -> np.ndarray:
    """f32[H/2] rotary frequencies, with linear or Llama-3.1 scaling (computed in float64 on the
    host: a constant of the traced step)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq.astype(np.float32)
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: wavelengths above original_len / low_freq_factor are divided by factor, those below
    # original_len / high_freq_factor kept, and the band between interpolated linearly in 1/freq.
    original = scaling.original_max_position_embeddings
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
    scaled = np.where(wavelen > original / scaling.low_freq_factor, inv_freq / scaling.factor,
                      np.where(wavelen < original / scaling.high_freq_factor, inv_freq,
                               interpolated))
    return scaled.astype(np.float32)


def rope(x: jax.Array, positions: jax.Array, theta: float,
         scaling: RopeScaling | None = None) -> jax.Array:
    """Rotary embedding, rotate-half convention (as Hugging Face Llama). x: [..., L, heads, H]."""
    inv_freq = jnp.asarray(rope_inv_freq(x.shape[-1], theta, scaling))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., L, H/2]
    cos = jnp.cos(angles)[..., None, :]
    sin = jnp.sin(angles)[..., None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _linear(din: int, dout: int, config: LlamaConfig, rngs: nnx.Rngs, dtype, param_dtype,
            use_bias: bool = False):
    init = nnx.initializers.normal(config.initializer_range)
    return nnx.Linear(din, dout, use_bias=use_bias, kernel_init=init, dtype=dtype,
                      param_dtype=param_dtype, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.rope_theta = config.rope_theta
        self.rope_scaling = config.rope_scaling
        self.sliding_window = config.sliding_window
        bias = config.attention_bias
        self.q_proj = _linear(d, n * h, config, rngs, dtype, param_dtype, bias)
        self.k_proj = _linear(d, k * h, config, rngs, dtype, param_dtype, bias)
        self.v_proj = _linear(d, k * h, config, rngs, dtype, param_dtype, bias)
        self.o_proj = _linear(n * h, d, config, rngs, dtype, param_dtype, config.o_proj_bias)
        if config.qk_norm:  # Qwen3
            self.q_norm = RMSNorm(h, config.rms_norm_eps, param_dtype=param_dtype)
            self.k_norm = RMSNorm(h, config.rms_norm_eps, param_dtype=param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def _qkv(self, x: jax.Array, positions: jax.Array):
        lead = x.shape[:-1]
        q = self.q_proj(x).reshape(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return (rope(q, positions, self.rope_theta, self.rope_scaling),
                rope(k, positions, self.rope_theta, self.rope_scaling), v)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, L, D] -> [B, L, D]
        batch, length, _ = x.shape
        q, k, v = self._qkv(x, jnp.arange(length))
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(batch, length, self.num_kv_heads, group, self.head_dim)
        scores = jnp.einsum("BLKGH,BMKH->BKGLM", q.astype(jnp.float32), k.astype(jnp.float32))
        scores *= self.head_dim ** -0.5
        pos = jnp.arange(length)
        visible = pos[None, :] <= pos[:, None]
        if self.sliding_window is not None:
            visible &= pos[None, :] > pos[:, None] - self.sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("BKGLM,BMKH->BLKGH", probs, v.astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.head_dim))

    def forward_paged(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                      metadata: AttentionMetadata, backend: AttentionBackend):
        q, k, v = self._qkv(x, positions)  # [T, N, H], [T, K, H], [T, K, H]
        out, kv_cache = paged_attention(q, k, v, kv_cache, metadata,
                                        scale=self.head_dim ** -0.5, backend=backend,
                                        sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(x.shape[0], -1)), kv_cache


class MLP(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        d, f = config.hidden_size, config.intermediate_size
        bias = config.mlp_bias
        self.gate_proj = _linear(d, f, config, rngs, dtype, param_dtype, bias)
        self.up_proj = _linear(d, f, config, rngs, dtype, param_dtype, bias)
        self.down_proj = _linear(f, d, config, rngs, dtype, param_dtype, bias)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype, param_dtype):
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, param_dtype=param_dtype)
        self.self_attn = Attention(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, param_dtype=param_dtype)
        self.mlp = MLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_paged(self, x, positions, kv_cache, metadata, backend):
        attn, kv_cache = self.self_attn.forward_paged(self.input_layernorm(x), positions,
                                                      kv_cache, metadata, backend)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), kv_cache


class LlamaForCausalLM(nnx.Module):
    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32,
                 param_dtype=jnp.float32):
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(
            config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype,
            embedding_init=nnx.initializers.normal(config.initializer_range), rngs=rngs)
        self.layers = nnx.List([DecoderLayer(config, rngs=rngs, dtype=dtype,
                                             param_dtype=param_dtype)
                                for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        self.lm_head = (None if config.tie_word_embeddings else
                        _linear(config.hidden_size, config.vocab_size, config, rngs, dtype,
                                param_dtype))

    def logits(self, hidden: jax.Array) -> jax.Array:  # [..., D] -> f32[..., V]
        return project_logits(self.norm, self.embed_tokens, self.lm_head, hidden)

    def __call__(self, token_ids: jax.Array) -> jax.Array:  # i32[B, L] -> f32[B, L, V]
        x = self.embed_tokens(token_ids)
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
        the reference for models.serving's scanned form."""
        x = self.embed_tokens(token_ids)
        blocks_per_layer = kv_cache.shape[2] // len(self.layers)
        block_size = kv_cache.shape[3]
        for index, layer in enumerate(self.layers):
            x, kv_cache = layer.forward_paged(
                x, positions, kv_cache, for_layer(metadata, index, blocks_per_layer, block_size),
                backend)
        return x, kv_cache


def project_logits(norm: RMSNorm, embed_tokens: nnx.Embed, lm_head: nnx.Linear | None,
                   hidden: jax.Array) -> jax.Array:  # [..., D] -> f32[..., V]
    """The final norm and the vocabulary projection (the tied embedding when lm_head is None)."""
    hidden = norm(hidden)
    if lm_head is None:
        return embed_tokens.attend(hidden).astype(jnp.float32)
    return lm_head(hidden).astype(jnp.float32)


def init_model(config: LlamaConfig, seed: int = 0, dtype=jnp.float32,
               param_dtype=jnp.float32) -> LlamaForCausalLM:
    """A randomly initialised model, deterministic in seed."""
    return LlamaForCausalLM(config, rngs=nnx.Rngs(seed), dtype=dtype, param_dtype=param_dtype)
