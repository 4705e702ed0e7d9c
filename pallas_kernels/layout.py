"""The KV-cache layout. Only pallas_kernels indexes the cache; everyone else asks this module.

One array per layer, K and V stacked in front: f32|bf16[2, K, NB, S, Hc]
(2 = key/value, K KV heads, NB physical blocks, S block size, Hc the cache head dim). A page of one
KV head is contiguous, the layout JAX's shipped paged-attention ops read. Block 0 is the null block.

Hc is the model's head dim H, except for the GPU kernels (backends gpu and mosaic_gpu, one
layout), whose tiles must be powers of two of at least 16: there H is zero-padded, e.g.
80 -> 128 (zeros change no dot product).

A quantized cache (int8, fp8) is a QuantizedKV: the data as above and f32 scales [2, K, NB, Ss],
one per token and KV head, Ss = S except on the TPU, where a page's scale row is padded to whole
128-lane tiles (scale_lanes): XLA lays an f32 array with a 16-wide minor axis out transposed,
and every kernel reading it row by row then cost a relayout copy of the whole pool a step
(tests/test_kernels_tpu_compile.py checks the step makes none).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.quant import QuantizedKV, is_quantized, quantize


PADDED_HEAD_DIM_BACKENDS = ("gpu", "mosaic_gpu")
PADDED_SCALE_BACKENDS = ("tpu",)
LANES = 128  # a TPU vector register's lanes
NULL_BLOCK = 0  # the scheduler's null block (scheduler.block_pool): padding writes land there


def cache_head_dim(head_dim: int, backend: str = "reference") -> int:
    if backend in PADDED_HEAD_DIM_BACKENDS:
        return max(16, 1 << (head_dim - 1).bit_length())
    return head_dim


def scale_lanes(block_size: int, backend: str = "reference") -> int:
    """Ss: the length of a page's scale row (see the module docstring)."""
    if backend in PADDED_SCALE_BACKENDS:
        return -(-block_size // LANES) * LANES
    return block_size


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   backend: str = "reference") -> tuple[int, ...]:
    """Shape of one layer's cache."""
    return (2, num_kv_heads, num_blocks, block_size, cache_head_dim(head_dim, backend))


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype, backend: str = "reference") -> int:
    """Bytes of one physical block across all layers: 2 * L * S * K * Hc * itemsize, plus the
    f32 scales of quantized (int8, fp8) caches: 2 * L * Ss * K * 4."""
    data = 2 * num_layers * block_size * num_kv_heads * cache_head_dim(head_dim, backend)
    data *= np.dtype(dtype).itemsize
    if is_quantized(dtype):
        data += 2 * num_layers * scale_lanes(block_size, backend) * num_kv_heads * 4
    return data


def init_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype, backend: str = "reference") -> list:
    """One cache per layer: an array, or a QuantizedKV for int8 / fp8."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, backend)
    if is_quantized(dtype):
        scales = (*shape[:3], scale_lanes(block_size, backend))
        return [QuantizedKV(jnp.zeros(shape, dtype), jnp.ones(scales, jnp.float32))
                for _ in range(num_layers)]
    return [jnp.zeros(shape, dtype) for _ in range(num_layers)]


def write_kv_reference(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T] block * S + offset; padding tokens point into the null block
) -> jax.Array:
    """Scatters the step's new keys and values into their slots; returns the new cache."""
    if isinstance(kv_cache, QuantizedKV):
        return _write_quantized(kv_cache, k, v, slot_mapping)
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.shape
    flat = kv_cache.reshape(2, num_kv_heads, num_blocks * block_size, head_dim)
    new = jnp.stack([k, v]).astype(kv_cache.dtype).transpose(0, 2, 1, 3)  # [2, K, T, H]
    if new.shape[-1] < head_dim:  # a padded cache layout (see cache_head_dim)
        new = jnp.pad(new, ((0, 0), (0, 0), (0, 0), (0, head_dim - new.shape[-1])))
    flat = flat.at[:, :, slot_mapping].set(new, mode="promise_in_bounds")
    return flat.reshape(kv_cache.shape)


def _write_quantized(kv_cache: QuantizedKV, k, v, slot_mapping) -> QuantizedKV:
    _, num_kv_heads, num_blocks, block_size, head_dim = kv_cache.data.shape
    data, scales = quantize(jnp.stack([k, v]), kv_cache.data.dtype)  # [2, T, K, H], f32[2, T, K]
    if data.shape[-1] < head_dim:
        data = jnp.pad(data, ((0, 0), (0, 0), (0, 0), (0, head_dim - data.shape[-1])))
    flat = kv_cache.data.reshape(2, num_kv_heads, num_blocks * block_size, head_dim)
    flat = flat.at[:, :, slot_mapping].set(data.transpose(0, 2, 1, 3), mode="promise_in_bounds")
    blocks, offsets = jnp.divmod(slot_mapping, block_size)
    new_scales = kv_cache.scales.at[:, :, blocks, offsets].set(scales.transpose(0, 2, 1),
                                                                mode="promise_in_bounds")
    return QuantizedKV(flat.reshape(kv_cache.data.shape), new_scales)


def copy_blocks(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    src: jax.Array,  # i32[C] blocks to copy from
    dst: jax.Array,  # i32[C] blocks to copy to; padding pairs are (0, 0)
    num_copies: jax.Array,  # i32[] only the first num_copies pairs are real
) -> jax.Array:
    """Copy-on-write: block src[i] -> dst[i] for every layer's cache, skipped entirely (no pool
    traffic) when the step has no copies."""

    def copy(cache):
        return jax.tree.map(
            lambda a: a.at[:, :, dst].set(a[:, :, src], mode="promise_in_bounds"), cache)

    return jax.lax.cond(num_copies > 0, copy, lambda cache: cache, kv_cache)


@jax.jit
def gather_blocks(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    blocks: jax.Array,  # i32[C]
) -> jax.Array:  # [2, K, C, S, Hc]
    """Reads blocks out of a layer's cache (swap-out); a pytree like the cache."""
    return jax.tree.map(lambda a: a[:, :, blocks], kv_cache)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    blocks: jax.Array,  # i32[C]; padding entries point at the null block
    data: jax.Array,  # [2, K, C, S, Hc]
) -> jax.Array:
    """Writes whole blocks into a layer's cache in place (swap-in); data is a pytree like the
    cache."""
    return jax.tree.map(
        lambda a, d: a.at[:, :, blocks].set(d.astype(a.dtype), mode="promise_in_bounds"),
        kv_cache, data)
