"""Self-attention with RoPE for every family: grouped-query heads, optional q/k biases and q/k
RMSNorm, the layer's own window and RoPE base (config.layer_window / layer_rope: Gemma's
alternating sliding and global layers), the attention scale (query_pre_attn_scalar) and logit
soft-capping, RoPE on the first rotary_dim dims of a head only (partial_rotary_factor) and the
output gated by sigmoid of a second half of q_proj (attn_output_gate: Qwen3.5, Qwen3-Next). Two paths over the same weights: dense causal (`__call__`) and paged
(`forward_paged`, through pallas_kernels.paged_attention)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.layers.basic import RMSNorm, linear, rms_norm, rope
from pagedjax.models.layers.lora import LayerLoRA, apply_lora, row_parallel
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, paged_attention


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(x / cap) (Gemma 2's logit soft-capping); x unchanged when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


class Attention(nnx.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0, *, rngs: nnx.Rngs, dtype,
                 param_dtype):
        d, n, k, h = config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = n, k, h
        self.rope_theta, self.rope_scaling = config.layer_rope(layer)
        self.sliding_window = config.layer_window(layer)
        self.scale = config.attention_scale
        self.soft_cap = config.attn_logit_softcapping
        bias = config.attention_bias
        self.rotary_dim = config.rotary_dim
        self.output_gate = config.attn_output_gate  # q_proj: per head its query, then its gate
        self.q_proj = linear(d, n * h * (2 if self.output_gate else 1), config, rngs, dtype,
                             param_dtype, bias)
        self.k_proj = linear(d, k * h, config, rngs, dtype, param_dtype, bias)
        self.v_proj = linear(d, k * h, config, rngs, dtype, param_dtype, bias)
        self.o_proj = linear(n * h, d, config, rngs, dtype, param_dtype, config.o_proj_bias)
        self.qk_norm_whole = config.qk_norm_whole
        self.clip_qkv = config.clip_qkv
        # gpt-oss: a logit a head joining every softmax with no value (f32, as vLLM and
        # tpu-inference keep them)
        self.sinks = nnx.Param(jnp.zeros((n,), jnp.float32)) if config.attention_sinks else None
        self.q_norm: RMSNorm | None
        self.k_norm: RMSNorm | None
        if config.qk_norm:  # Qwen3, Gemma 3: over a head; OLMoE: over the whole projection
            whole = config.qk_norm_whole
            self.q_norm = rms_norm(config, n * h if whole else h, param_dtype)
            self.k_norm = rms_norm(config, k * h if whole else h, param_dtype)
        else:
            self.q_norm = self.k_norm = None

    def _qkv(self, x: jax.Array, positions: jax.Array, lora: LayerLoRA | None = None):
        lead = x.shape[:-1]
        q, k, v = (apply_lora(lora, name, x, getattr(self, name)(x))
                   for name in ("q_proj", "k_proj", "v_proj"))
        gate = None
        if self.output_gate:
            q, gate = jnp.split(q.reshape(*lead, self.num_heads, 2 * self.head_dim), 2, axis=-1)
            q, gate = q.reshape(*lead, -1), gate.reshape(*lead, -1)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (jnp.clip(t, -self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(*lead, self.num_heads, self.head_dim)
        k = k.reshape(*lead, self.num_kv_heads, self.head_dim)
        v = v.reshape(*lead, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q), self.k_norm(k)
        return self._rope(q, positions), self._rope(k, positions), v, gate

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """RoPE on the first rotary_dim dims of each head, the rest as they are."""
        if self.rotary_dim == self.head_dim:
            return rope(x, positions, self.rope_theta, self.rope_scaling)
        rotated = rope(x[..., :self.rotary_dim], positions, self.rope_theta, self.rope_scaling)
        return jnp.concatenate([rotated, x[..., self.rotary_dim:]], axis=-1)

    def _gated(self, out: jax.Array, gate: jax.Array | None) -> jax.Array:
        """out [..., N * H] times sigmoid(gate) (attn_output_gate), in out's dtype."""
        if gate is None:
            return out
        return (out * jax.nn.sigmoid(gate.astype(jnp.float32))).astype(out.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, L, D] -> [B, L, D]
        batch, length, _ = x.shape
        q, k, v, gate = self._qkv(x, jnp.arange(length))
        group = self.num_heads // self.num_kv_heads
        q = q.reshape(batch, length, self.num_kv_heads, group, self.head_dim)
        scores = jnp.einsum("BLKGH,BMKH->BKGLM", q.astype(jnp.float32), k.astype(jnp.float32))
        scores = soft_cap(scores * self.scale, self.soft_cap)
        pos = jnp.arange(length)
        visible = pos[None, :] <= pos[:, None]
        if self.sliding_window is not None:
            visible &= pos[None, :] > pos[:, None] - self.sliding_window
        scores = jnp.where(visible, scores, -jnp.inf)
        if self.sinks is not None:  # one more column, its probability dropped
            sinks = self.sinks[...].astype(jnp.float32).reshape(self.num_kv_heads, group)
            column = jnp.broadcast_to(sinks[None, :, :, None, None], (*scores.shape[:-1], 1))
            probs = jax.nn.softmax(jnp.concatenate([scores, column], axis=-1), axis=-1)[..., :-1]
        else:
            probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("BKGLM,BMKH->BLKGH", probs, v.astype(jnp.float32)).astype(x.dtype)
        out = self._gated(out.reshape(batch, length, self.num_heads * self.head_dim), gate)
        return self.o_proj(out)

    def forward_paged(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                      metadata: AttentionMetadata, backend: AttentionBackend,
                      lora: LayerLoRA | None = None):
        """lora: the step's adapters (models/layers/lora.py), None for the base model."""
        q, k, v, gate = self._qkv(x, positions, lora)  # [T, N, H], [T, K, H], [T, K, H]
        out, kv_cache = paged_attention(q, k, v, kv_cache, metadata, scale=self.scale,
                                        backend=backend, sliding_window=self.sliding_window,
                                        soft_cap=self.soft_cap,
                                        sinks=None if self.sinks is None else self.sinks[...])
        out = self._gated(out.reshape(x.shape[0], -1), gate)
        return row_parallel(self.o_proj, "o_proj", out, lora), kv_cache
