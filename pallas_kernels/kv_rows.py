"""Reading a paged KV cache's rows in f32, dequantized from int8 when the cache is
(pallas_kernels.quant.QuantizedKV): whole blocks, or one row a token."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.pallas_kernels.quant import QuantizedKV


def load_blocks(kv_cache, kv_index: int, blocks: jax.Array) -> jax.Array:
    """f32 K or V of blocks (any shape of ids), dequantized from int8 when the cache is."""
    if isinstance(kv_cache, QuantizedKV):
        data = kv_cache.data[kv_index][:, blocks].astype(jnp.float32)
        scales = kv_cache.scales[kv_index][:, blocks][..., :data.shape[-2]]  # TPU rows: padded
        return data * scales[..., None]
    return kv_cache[kv_index][:, blocks].astype(jnp.float32)


def load_rows(kv_cache, kv_index: int, blocks: jax.Array, offsets: jax.Array) -> jax.Array:
    """f32[K, T, H]: one cached row a token (block blocks[t], row offsets[t]), dequantized
    when the cache is."""
    if isinstance(kv_cache, QuantizedKV):
        data = kv_cache.data[kv_index][:, blocks, offsets].astype(jnp.float32)
        return data * kv_cache.scales[kv_index][:, blocks, offsets][..., None]
    return kv_cache[kv_index][:, blocks, offsets].astype(jnp.float32)
