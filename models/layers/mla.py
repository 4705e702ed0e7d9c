"""Multi-head latent attention (DeepSeek-V2 / V3): a token's K and V compressed into one latent
c of kv_lora_rank values (kv_a_proj_with_mqa, then kv_a_layernorm) plus a RoPE key k_pe of
qk_rope_head_dim values shared by every head; per head, its no-RoPE key and its value are the
latent's up-projections (kv_b_proj: [kv_lora_rank] -> N x [qk_nope_head_dim | v_head_dim]). The
query: q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj (q_lora_rank), N x [nope | rope].

Two paths over the same weights:

- dense (`__call__`): the expanded form, as transformers computes it: keys [k_nope, k_pe] and
  values per head, causal softmax.
- paged (`forward_paged`): the absorbed form (a prefill step of the right shape: the expanded
  one, models/layers/mla_expanded.py). The cache holds [c, k_pe] a token (one plane, one
  "KV head": pallas_kernels.layout), a quarter of GQA's bytes. W_UK folds into the query
  (q_nope W_UK: the latent's kv_lora_rank dims) and W_UV into the output, so attention is MQA
  over the latent: scores q_nope W_UK . c + q_pe . k_pe, values c, then each head's output
  times its W_UV. The same sums in another order: equal up to rounding.

RoPE dims in interleaved pairs (DeepSeek's checkpoints: rope_interleave) are taken even dims
first, then odd, then rotated half against half: the same rotation of each pair, and q_pe . k_pe
does not depend on the order the dims are stored in, as long as query and key share it.

Under tensor parallelism the heads split over the devices and each device keeps the whole
latent (the cache's one KV head repeated, a copy a device: pagedjax.parallel.sharding);
num_kv_heads is those copies.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pagedjax.models.config import LlamaConfig
from pagedjax.models.layers import mla_expanded
from pagedjax.models.layers.basic import RMSNorm, linear, rope
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata, paged_attention
from pagedjax.pallas_kernels.dispatch import write_kv

LATENT_NORM_EPS = 1e-6  # q_a_layernorm, kv_a_layernorm: transformers' default, not rms_norm_eps


class LatentAttention(nnx.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0, *, rngs: nnx.Rngs, dtype,
                 param_dtype):
        d, n = config.hidden_size, config.num_heads
        self.num_heads, self.num_kv_heads = n, config.num_kv_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.latent, self.v_dim = config.kv_lora_rank, config.v_head_dim
        self.rope_theta, self.rope_scaling = config.layer_rope(layer)
        self.interleave = config.rope_interleave
        self.scale = config.attention_scale
        bias = config.attention_bias
        query = n * config.head_dim
        rank = config.q_lora_rank
        self.q_proj: nnx.Linear | None
        self.q_a_proj: nnx.Linear | None
        self.q_a_layernorm: RMSNorm | None
        self.q_b_proj: nnx.Linear | None
        if rank is None:
            self.q_proj = linear(d, query, config, rngs, dtype, param_dtype)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = linear(d, rank, config, rngs, dtype, param_dtype, bias)
            self.q_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS, param_dtype=param_dtype)
            self.q_b_proj = linear(rank, query, config, rngs, dtype, param_dtype)
        self.kv_a_proj_with_mqa = linear(d, self.latent + self.rope_dim, config, rngs, dtype,
                                         param_dtype, bias)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_NORM_EPS, param_dtype=param_dtype)
        self.kv_b_proj = linear(self.latent, n * (self.nope + self.v_dim), config, rngs, dtype,
                                param_dtype)
        self.o_proj = linear(n * self.v_dim, d, config, rngs, dtype, param_dtype,
                             config.o_proj_bias)

    def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:  # [..., L, heads, R]
        if self.interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rope(x, positions, self.rope_theta, self.rope_scaling)

    def _project(self, x: jax.Array, positions: jax.Array):
        """(q_nope [..., L, N, nope], q_pe [..., L, N, R] roped, latent [..., L, Dl] normed,
        k_pe [..., L, R] roped)."""
        lead = x.shape[:-1]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:  # the low-rank query (q_lora_rank): all three are set
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))  # type: ignore[misc]
        q = q.reshape(*lead, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., :self.nope], q[..., self.nope:]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :self.latent])
        k_pe = self._rope(compressed[..., None, self.latent:], positions)[..., 0, :]
        return q_nope, self._rope(q_pe, positions), latent, k_pe

    def _up_projections(self) -> tuple[jax.Array, jax.Array]:
        """(W_UK [Dl, N, nope], W_UV [Dl, N, v]): kv_b_proj's kernel by head (a quantized one's
        dequantized: models/layers/quantized.QuantizedLinear)."""
        proj = self.kv_b_proj
        kernel = proj.weight().astype(proj.dtype) if hasattr(proj, "weight") else \
            proj.kernel[...]
        kernel = kernel.reshape(self.latent, self.num_heads, self.nope + self.v_dim)
        return kernel[..., :self.nope], kernel[..., self.nope:]

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, L, D] -> [B, L, D]
        batch, length, _ = x.shape
        q_nope, q_pe, latent, k_pe = self._project(x, jnp.arange(length))
        kv = self.kv_b_proj(latent).reshape(batch, length, self.num_heads, -1)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:-1], self.rope_dim))
        q = jnp.concatenate([q_nope, q_pe], axis=-1).astype(jnp.float32)
        k = jnp.concatenate([k_nope, k_pe], axis=-1).astype(jnp.float32)
        scores = jnp.einsum("BLNH,BMNH->BNLM", q, k) * self.scale
        pos = jnp.arange(length)
        scores = jnp.where(pos[None, :] <= pos[:, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("BNLM,BMNV->BLNV", probs, v.astype(jnp.float32)).astype(x.dtype)
        return self.o_proj(out.reshape(batch, length, self.num_heads * self.v_dim))

    def forward_paged(self, x: jax.Array, positions: jax.Array, kv_cache: jax.Array,
                      metadata: AttentionMetadata, backend: AttentionBackend, lora=None):
        """The absorbed form over the latent cache (module docstring). lora: None (adapters
        on latent attention are refused before a step: pagedjax.lora)."""
        if lora is not None:
            raise ValueError("LoRA adapters on multi-head latent attention are not supported")
        q_nope, q_pe, latent, k_pe = self._project(x, positions)
        w_uk, w_uv = self._up_projections()
        row = jnp.concatenate([latent, k_pe.astype(latent.dtype)], axis=-1)  # [T, Dl + R]
        k = jnp.broadcast_to(row[:, None, :], (row.shape[0], self.num_kv_heads, row.shape[-1]))

        def absorbed(kv_cache, write: bool = True):
            q_latent = jnp.einsum("TNn,lNn->TNl", q_nope, w_uk.astype(q_nope.dtype),
                                  preferred_element_type=jnp.float32)
            q = jnp.concatenate([q_latent.astype(x.dtype), q_pe.astype(x.dtype)], axis=-1)
            out, kv_cache = paged_attention(q, k, None, kv_cache, metadata, scale=self.scale,
                                            backend=backend, value_dim=self.latent,
                                            write=write)
            return jnp.einsum("TNl,lNv->TNv", out, w_uv.astype(out.dtype),
                              preferred_element_type=jnp.float32).astype(x.dtype), kv_cache

        block_size = jax.tree.leaves(kv_cache)[0].shape[3]
        if mla_expanded.chosen(self, backend, metadata, x.shape[0], block_size,
                               jnp.dtype(x.dtype).itemsize):
            kv_cache = write_kv(kv_cache, k, None, metadata, backend)
            out = jax.lax.cond(
                mla_expanded.fresh(metadata),
                lambda: mla_expanded.expanded_attention(
                    self, q_nope, q_pe, latent, k_pe, w_uk, w_uv, metadata, backend,
                    block_size).astype(x.dtype),
                lambda: absorbed(kv_cache, write=False)[0])
        else:
            out, kv_cache = absorbed(kv_cache)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_dim)), kv_cache
