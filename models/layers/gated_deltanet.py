"""Gated DeltaNet: the linear-attention layers of Qwen3.5 and Qwen3-Next
(`layer_types` "linear_attention"), as transformers' Qwen3_5GatedDeltaNet /
Qwen3NextGatedDeltaNet compute them.

x -> q, k, v (one projection), z (the output gate), b (write strength, beta = sigmoid(b)) and a
(decay, g = -exp(A_log) * softplus(a + dt_bias)); q, k, v through a causal depthwise conv1d
(kernel linear_conv_kernel_dim, SiLU); the gated delta rule (pallas_kernels/gated_delta.py);
a per-head RMSNorm of the output times SiLU(z); out_proj. Qwen3-Next stores the projections
fused and interleaved by key head (`in_proj_qkvz`, `in_proj_ba`: per key head its q, k, its
value heads' v, then their z; its value heads' b then a); Qwen3.5 as four (`in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a`). Both are read as stored and split here.

The layer keeps no per-token KV: a sequence's state is the conv's last K - 1 inputs
[K - 1, X] and the recurrent matrix [Hv, Dk, Dv], kept in its blocks of the KV cache's state
group (pallas_kernels/state_pages.py) between steps; a row whose first query token is at
position 0 starts from zeros instead (a new sequence, or one recomputed after preemption).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.models.config import LlamaConfig
from pagedjax.models.layers.basic import linear
from pagedjax.pallas_kernels import AttentionBackend, AttentionMetadata
from pagedjax.pallas_kernels.dispatch import TP_AXIS
from pagedjax.pallas_kernels.gated_delta import (causal_conv1d, chunked_gated_delta,
                                                 ragged_causal_conv1d, ragged_gated_delta)
from pagedjax.pallas_kernels.gated_delta_step import kernels_for
from pagedjax.pallas_kernels.state_pages import page_values, read_states, state_blocks, write_states

CHUNK_SIZE = 64  # the chunked rule's C (flash-linear-attention's and transformers')


class GatedRMSNorm(nnx.Module):
    """RMSNorm over a head's Dv (weight applied as is, initialised to 1) times SiLU(gate) in f32
    (transformers' Qwen3NextRMSNormGated)."""

    def __init__(self, dim: int, eps: float, *, param_dtype):
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array, gate: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        normed = self.weight[...] * normed.astype(x.dtype)
        return (normed * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


class Conv1d(nnx.Module):
    """The depthwise conv's weight as transformers stores it: [X, 1, K]."""

    def __init__(self, channels: int, taps: int, config: LlamaConfig, rngs: nnx.Rngs,
                 param_dtype):
        init = nnx.initializers.normal(config.initializer_range)
        self.weight = nnx.Param(init(rngs.params(), (channels, 1, taps), param_dtype))


class GatedDeltaNet(nnx.Module):
    def __init__(self, config: LlamaConfig, layer: int = 0, *, rngs: nnx.Rngs, dtype,
                 param_dtype):
        d = config.hidden_size
        self.num_k_heads, self.num_v_heads = (config.linear_num_key_heads,
                                              config.linear_num_value_heads)
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = config.linear_conv_dim
        self.conv_taps = config.linear_conv_kernel_dim
        self.fused = config.linear_fused_projections
        make = lambda out: linear(d, out, config, rngs, dtype, param_dtype)  # noqa: E731
        if self.fused:
            self.in_proj_qkvz = make(2 * self.key_dim + 2 * self.value_dim)
            self.in_proj_ba = make(2 * self.num_v_heads)
        else:
            self.in_proj_qkv = make(self.conv_dim)
            self.in_proj_z = make(self.value_dim)
            self.in_proj_b = make(self.num_v_heads)
            self.in_proj_a = make(self.num_v_heads)
        self.conv1d = Conv1d(self.conv_dim, self.conv_taps, config, rngs, param_dtype)
        self.dt_bias = nnx.Param(jnp.ones((self.num_v_heads,), param_dtype))
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(
            rngs.params(), (self.num_v_heads,), param_dtype, 0.01, 16.0)))
        self.norm = GatedRMSNorm(self.head_v_dim, config.rms_norm_eps, param_dtype=param_dtype)
        self.out_proj = linear(self.value_dim, d, config, rngs, dtype, param_dtype)

    def project(self, x: jax.Array):
        """x [..., D] -> (qkv [..., X] (the conv's input: q, k then v), z [..., Hv, Dv],
        b, a [..., Hv])."""
        lead = x.shape[:-1]
        if not self.fused:
            return (self.in_proj_qkv(x), self.in_proj_z(x).reshape(*lead, self.num_v_heads,
                                                                    self.head_v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        per = self.num_v_heads // self.num_k_heads  # value heads a key head serves
        dk, dv = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).reshape(*lead, self.num_k_heads, 2 * dk + 2 * per * dv)
        q, k, v, z = jnp.split(qkvz, [dk, 2 * dk, 2 * dk + per * dv], axis=-1)
        ba = self.in_proj_ba(x).reshape(*lead, self.num_k_heads, 2 * per)
        b, a = (t.reshape(*lead, self.num_v_heads) for t in jnp.split(ba, 2, axis=-1))
        qkv = jnp.concatenate([t.reshape(*lead, -1) for t in (q, k, v)], axis=-1)
        return qkv, z.reshape(*lead, self.num_v_heads, dv), b, a

    def conv_weight(self) -> jax.Array:  # [X, K]
        return self.conv1d.weight[...][:, 0, :]

    def split_heads(self, qkv: jax.Array):
        """The conv's output [..., X] -> q, k [..., Hk, Dk], v [..., Hv, Dv]."""
        lead = qkv.shape[:-1]
        q, k, v = jnp.split(qkv, [self.key_dim, 2 * self.key_dim], axis=-1)
        return (q.reshape(*lead, self.num_k_heads, self.head_k_dim),
                k.reshape(*lead, self.num_k_heads, self.head_k_dim),
                v.reshape(*lead, self.num_v_heads, self.head_v_dim))

    def gates(self, b: jax.Array, a: jax.Array) -> tuple[jax.Array, jax.Array]:
        return gates(self.A_log[...], self.dt_bias[...], b, a)

    def output(self, core: jax.Array, z: jax.Array, dtype) -> jax.Array:
        """The rule's output [..., Hv, Dv] normed, gated by z, through out_proj -> [..., D]."""
        gated = self.norm(core.astype(dtype), z)
        return self.out_proj(gated.reshape(*gated.shape[:-2], self.value_dim))

    def __call__(self, x: jax.Array) -> jax.Array:  # [B, L, D] -> [B, L, D], from no state
        qkv, z, b, a = self.project(x)
        qkv, _ = causal_conv1d(qkv, self.conv_weight())
        q, k, v = self.split_heads(qkv)
        g, beta = self.gates(b, a)
        core, _ = chunked_gated_delta(q, k, v, g, beta, chunk_size=CHUNK_SIZE)
        return self.output(core, z, x.dtype)

    @property
    def state_values(self) -> int:
        """A sequence's state: the conv window, then the recurrent matrix."""
        return ((self.conv_taps - 1) * self.conv_dim
                + self.num_v_heads * self.head_k_dim * self.head_v_dim)

    def forward_paged(self, x: jax.Array, kv_cache: jax.Array, metadata: AttentionMetadata,
                      backend: AttentionBackend = AttentionBackend()):
        """x [T, D] of a step's rows -> ([T, D], the cache with each row's new state).
        metadata.block_tables: the layer's state blocks a row (its group's, offset to its
        slot). backend: its platform's kernels (pallas_kernels/gated_delta_step.py);
        its mesh, tensor parallel: each device runs its heads (paged_core) on its shard of the
        cache's pages (split over KV heads); q, k and v come split by heads from the
        projection's columns."""
        qkv, z, b, a = self.project(x)
        q, k, v = jnp.split(qkv, [self.key_dim, 2 * self.key_dim], axis=-1)
        weights = jnp.split(self.conv_weight(), [self.key_dim, 2 * self.key_dim], axis=0)
        core = functools.partial(paged_core, dims=(self.head_k_dim, self.head_v_dim),
                                 decode_only=metadata.decode_only,
                                 kernels=kernels_for(backend.name, backend.interpret))
        mesh = backend.mesh
        args = (q, k, v, *weights, b, a, self.A_log[...], self.dt_bias[...], kv_cache,
                metadata.block_tables, metadata.cu_q_lens, metadata.kv_lens,
                metadata.cu_q_lens[metadata.num_seqs])
        if mesh is None:
            out, kv_cache = core(*args)
        else:
            heads, cache = P(None, TP_AXIS), P(None, TP_AXIS)
            out, kv_cache = jax.shard_map(
                core, mesh=mesh, in_specs=(heads,) * 3 + (P(TP_AXIS),) * 3 + (heads, heads)
                + (P(TP_AXIS),) * 2 + (cache,) + (P(),) * 4,
                out_specs=(heads, cache), check_vma=False)(*args)
        return self.output(out, z, x.dtype), kv_cache


def gates(a_log: jax.Array, dt_bias: jax.Array, b: jax.Array,
          a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)), f32: each token's decay
    and write strength, per value head."""
    g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return g, jax.nn.sigmoid(b.astype(jnp.float32))


def paged_core(q, k, v, conv_q, conv_k, conv_v, b, a, a_log, dt_bias, kv_cache, tables,
               cu_q_lens, kv_lens, num_real, *, dims: tuple[int, int], decode_only: bool,
               kernels=None):
    """The heads a device holds (all of them on one device): q, k [T, Hk * Dk], v [T, Hv * Dv]
    before the conv, their conv weights [channels, K], b, a [T, Hv], A_log and dt_bias [Hv],
    the cache (its heads' share of every page) -> (the rule's output f32[T, Hv, Dv], the cache
    with each row's new state: its conv window [K - 1, X] then its matrix [Hv, Dk, Dv], in the
    first n of its blocks; a row whose first query token is at position 0 starts from zeros)."""
    dk, dv = dims
    heads_k, heads_v = q.shape[-1] // dk, v.shape[-1] // dv
    weight = jnp.concatenate([conv_q, conv_k, conv_v], axis=0)
    channels, taps = weight.shape
    size = (taps - 1) * channels + heads_v * dk * dv
    tables = tables[:, :state_blocks(size, page_values(kv_cache))]
    batch = tables.shape[0]
    fresh = kv_lens == cu_q_lens[1:] - cu_q_lens[:-1]
    flat = jnp.where(fresh[:, None], 0.0, read_states(kv_cache, tables, size))
    windows = flat[:, :(taps - 1) * channels].reshape(batch, taps - 1, channels)
    states = flat[:, (taps - 1) * channels:].reshape(batch, heads_v, dk, dv)
    mixed, windows = ragged_causal_conv1d(jnp.concatenate([q, k, v], axis=-1), weight,
                                          windows.astype(q.dtype), cu_q_lens)
    q, k, v = jnp.split(mixed, [heads_k * dk, 2 * heads_k * dk], axis=-1)
    out, states = ragged_gated_delta(
        q.reshape(-1, heads_k, dk), k.reshape(-1, heads_k, dk), v.reshape(-1, heads_v, dv),
        *gates(a_log, dt_bias, b, a), states, cu_q_lens, num_real, decode_only,
        kernels=kernels)
    flat = jnp.concatenate([windows.reshape(batch, -1).astype(jnp.float32),
                            states.reshape(batch, -1)], axis=1)
    return out, write_states(kv_cache, tables, flat)
