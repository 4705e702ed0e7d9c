"""The KV-cache layout. Only pallas_kernels indexes the cache; everyone else asks this module.

One array for all layers, K and V stacked in front: f32|bf16[2, K, L * NB, S, Hc]
(2 = key/value planes, K KV heads, L layers, NB physical blocks a layer, S block size, Hc the cache head
dim). A page of one KV head is contiguous, the layout JAX's shipped paged-attention ops read.
The layers are folded into the block axis: layer l's block b is physical block l * NB + b
(layer_blocks), so every kernel reads one layer through offset block tables (a per-layer view
of a step's plan, attention.for_layer) and the layers of a step run under one jax.lax.scan with
the cache carried through and updated in place. The scheduler's block ids are a layer's, 0..NB-1;
block 0 is the null block, and it stays global block 0 in every layer: padding writes land
there, where the TPU KV write drops them.

Hc is the model's head dim H, except for the GPU kernels (backends gpu and mosaic_gpu, one
layout), whose tiles must be powers of two of at least 16: there H is zero-padded, e.g.
80 -> 128 (zeros change no dot product), a latent row aside (cache_head_dim); and on the TPU, where H is zero-padded to whole
128-lane tiles (64 -> 128: gpt-oss, Llama 3.2 1B), as tpu-inference pads it: a cache whose
minor axis is narrower than a vreg's lanes is laid out by XLA with its block axis minor, and
the kernels, which read it row-major, then cost a relayout copy of the whole pool a step, in
and out (benchmarks/results/tpu_new_architectures.md; the memory is the same: HBM tiles pad
a 64-wide row to 128 either way).

Multi-head latent attention (DeepSeek, models/layers/mla.py) keeps one plane, [1, 1, L * NB, S,
Hc]: a token's latent (kv_lora_rank values) and its RoPE key in one row, read as the key of one
KV head, its first kv_lora_rank values as the value (a quarter of GQA's bytes, none twice).

A quantized cache (int8, fp8) is a QuantizedKV: the data as above and f32 scales [2, K, NB, Ss],
one per token and KV head, Ss = S except on the TPU, where a page's scale row is padded to whole
128-lane tiles (scale_lanes): XLA lays an f32 array with a 16-wide minor axis out transposed,
and every kernel reading it row by row then cost a relayout copy of the whole pool a step
(tests/kernels/test_kernels_tpu_compile.py checks the step makes none).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.pallas_kernels.quant import QuantizedKV, is_quantized, quantize

PADDED_HEAD_DIM_BACKENDS = ("gpu", "mosaic_gpu")
LANE_PADDED_HEAD_DIM_BACKENDS = ("tpu",)
PADDED_SCALE_BACKENDS = ("tpu",)
LANES = 128  # a TPU vector register's lanes
NULL_BLOCK = 0  # the scheduler's null block (scheduler.block_pool): padding writes land there


def cache_head_dim(head_dim: int, backend: str = "reference", planes: int = 2) -> int:
    """Hc of a cache of head dim H (the module docstring); a latent cache (planes 1) on the GPU
    layout keeps its row unpadded: the Triton kernels read its latent and RoPE parts as two
    power-of-two tiles (gpu/triton/latent.py), 512 + 64, not 1,024."""
    if backend in PADDED_HEAD_DIM_BACKENDS and planes == 1:
        return head_dim
    if backend in PADDED_HEAD_DIM_BACKENDS:
        return max(16, 1 << (head_dim - 1).bit_length())
    if backend in LANE_PADDED_HEAD_DIM_BACKENDS:
        return -(-head_dim // LANES) * LANES
    return head_dim


def scale_lanes(block_size: int, backend: str = "reference") -> int:
    """Ss: the length of a page's scale row (see the module docstring)."""
    if backend in PADDED_SCALE_BACKENDS:
        return -(-block_size // LANES) * LANES
    return block_size


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                   backend: str = "reference", num_layers: int = 1,
                   planes: int = 2) -> tuple[int, ...]:
    """Shape of the cache of num_layers layers of num_blocks blocks each; planes 2 (K and V) or
    1 (a latent cache, see the module docstring)."""
    return (planes, num_kv_heads, num_layers * num_blocks, block_size,
            cache_head_dim(head_dim, backend, planes))


def layer_blocks(blocks, num_layers: int, blocks_per_layer: int):
    """i32[L, C]: each layer's physical ids of the scheduler's blocks (any 1-D ids, numpy on the
    host or jax in a step); the null block stays block 0 in every layer."""
    xp = np if isinstance(blocks, np.ndarray) else jnp
    offsets = xp.arange(num_layers, dtype=np.int32)[:, None] * blocks_per_layer
    return xp.where(blocks[None, :] == NULL_BLOCK, NULL_BLOCK, blocks[None, :] + offsets)


def check_num_slots(num_layers: int, num_blocks: int, block_size: int) -> None:
    """Slots are int32: L * NB * S of them must fit."""
    slots = num_layers * num_blocks * block_size
    if slots > np.iinfo(np.int32).max:
        raise ValueError(f"the KV cache holds {slots} slots (num_layers x num_blocks x "
                         f"block_size), more than int32 indexes ({np.iinfo(np.int32).max}): "
                         "lower num_blocks or kv_cache_memory_bytes")


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype, backend: str = "reference", planes: int = 2) -> int:
    """Bytes of one physical block across all layers: planes * L * S * K * Hc * itemsize, plus
    the f32 scales of quantized (int8, fp8) caches: planes * L * Ss * K * 4."""
    data = planes * num_layers * block_size * num_kv_heads
    data *= cache_head_dim(head_dim, backend, planes)
    data *= np.dtype(dtype).itemsize
    if is_quantized(dtype):
        data += planes * num_layers * scale_lanes(block_size, backend) * num_kv_heads * 4
    return data


def init_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype, backend: str = "reference", planes: int = 2):
    """The cache of every layer (layers folded into the block axis, see the module docstring):
    an array, or a QuantizedKV for int8 / fp8."""
    check_num_slots(num_layers, num_blocks, block_size)
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim, backend, num_layers,
                           planes)
    if is_quantized(dtype):
        scales = (*shape[:3], scale_lanes(block_size, backend))
        return QuantizedKV(jnp.zeros(shape, dtype), jnp.ones(scales, jnp.float32))
    return jnp.zeros(shape, dtype)


def write_kv_reference(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc] (or [1, ...]: a latent cache)
    k: jax.Array,  # [T, K, H]
    v: jax.Array | None,  # [T, K, H]; None for a latent cache (one plane)
    slot_mapping: jax.Array,  # i32[T] block * S + offset; padding tokens point into the null block
) -> jax.Array:
    """Scatters the step's new keys and values into their slots; returns the new cache."""
    if isinstance(kv_cache, QuantizedKV):
        return _write_quantized(kv_cache, k, v, slot_mapping)
    block_size, head_dim = kv_cache.shape[3:]
    new = jnp.stack(planes_of(k, v)).astype(kv_cache.dtype).transpose(0, 2, 1, 3)  # [2, K, T, H]
    if new.shape[-1] < head_dim:  # a padded cache layout (see cache_head_dim)
        new = jnp.pad(new, ((0, 0), (0, 0), (0, 0), (0, head_dim - new.shape[-1])))
    # Indexed by (block, offset), not through a [2, K, NB * S, H] view: with one KV head XLA
    # on the CPU made that reshape of the donated cache a copy of the whole pool every step.
    blocks, offsets = jnp.divmod(slot_mapping, block_size)
    return kv_cache.at[:, :, blocks, offsets].set(new, mode="promise_in_bounds")


def planes_of(k: jax.Array, v: jax.Array | None) -> list:
    """The planes a step writes: [k, v], or [k] for a latent cache (v None)."""
    return [k] if v is None else [k, v]


def _write_quantized(kv_cache: QuantizedKV, k, v, slot_mapping) -> QuantizedKV:
    block_size, head_dim = kv_cache.data.shape[3:]
    data, scales = quantize(jnp.stack(planes_of(k, v)), kv_cache.data.dtype)  # [2, T, K, H], f32[2, T, K]
    if data.shape[-1] < head_dim:
        data = jnp.pad(data, ((0, 0), (0, 0), (0, 0), (0, head_dim - data.shape[-1])))
    blocks, offsets = jnp.divmod(slot_mapping, block_size)  # no flat view: see above
    new_data = kv_cache.data.at[:, :, blocks, offsets].set(data.transpose(0, 2, 1, 3),
                                                            mode="promise_in_bounds")
    new_scales = kv_cache.scales.at[:, :, blocks, offsets].set(scales.transpose(0, 2, 1),
                                                                mode="promise_in_bounds")
    return QuantizedKV(new_data, new_scales)


def copy_blocks(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    src: jax.Array,  # i32[C] blocks to copy from
    dst: jax.Array,  # i32[C] blocks to copy to; padding pairs are (0, 0)
    num_copies: jax.Array,  # i32[] only the first num_copies pairs are real
) -> jax.Array:
    """Copy-on-write: physical block src[i] -> dst[i] (layer_blocks gives every layer's), skipped
    entirely (no pool traffic) when the step has no copies."""

    def copy(cache):
        return jax.tree.map(
            lambda a: a.at[:, :, dst].set(a[:, :, src], mode="promise_in_bounds"), cache)

    return jax.lax.cond(num_copies > 0, copy, lambda cache: cache, kv_cache)


@jax.jit
def gather_blocks(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    blocks: jax.Array,  # i32[C]
) -> jax.Array:  # [2, K, C, S, Hc]
    """Reads physical blocks out of the cache (swap-out); a pytree like the cache."""
    return jax.tree.map(lambda a: a[:, :, blocks], kv_cache)


@functools.partial(jax.jit, donate_argnums=(0,))
def scatter_blocks(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    blocks: jax.Array,  # i32[C]; padding entries point at the null block
    data: jax.Array,  # [2, K, C, S, Hc]
) -> jax.Array:
    """Writes whole physical blocks into the cache in place (swap-in); data is a pytree like
    the cache."""
    return jax.tree.map(
        lambda a, d: a.at[:, :, blocks].set(d.astype(a.dtype), mode="promise_in_bounds"),
        kv_cache, data)
