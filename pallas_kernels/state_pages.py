"""A linear-attention layer's per-sequence state kept in KV-cache pages (the engine's state
group: scheduler.state_group). The pool stays one array of one page size; a sequence's state
takes the first `size` values of its n state blocks read in the order [n, 2, K, S, Hc] (each
block whole in turn: its key then value half, head by head), in the cache's dtype. Only this
module (with layout) indexes the cache for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.pallas_kernels.quant import QuantizedKV, is_quantized


def page_values(kv_cache: jax.Array) -> int:
    """The values one block holds in one layer slot: 2 * K * S * Hc."""
    two, heads, _, block_size, head_dim = kv_cache.shape
    return two * heads * block_size * head_dim


def state_blocks(state_values: int, values_per_page: int) -> int:
    """The blocks a state of state_values takes."""
    return -(-state_values // values_per_page)


def read_states(kv_cache: jax.Array, tables: jax.Array, size: int) -> jax.Array:
    """f32[B, size]: each row's state from its physical blocks tables i32[B, n] (layer
    offsets applied; a padding row's point at the null block and read what lies there)."""
    if isinstance(kv_cache, QuantizedKV) or is_quantized(kv_cache.dtype):
        raise ValueError("a state group needs an unquantized KV cache")
    pages = kv_cache[:, :, tables]  # [2, K, B, n, S, Hc]
    rows = jnp.moveaxis(jnp.moveaxis(pages, 2, 0), 3, 1)  # [B, n, 2, K, S, Hc]
    return rows.reshape(tables.shape[0], -1)[:, :size].astype(jnp.float32)


def write_states(kv_cache: jax.Array, tables: jax.Array, states: jax.Array) -> jax.Array:
    """The cache with each row's state [B, size] written into its blocks (read_states' order;
    the blocks' values past size become zeros). Padding rows write the null block."""
    batch, n = tables.shape
    two, heads, _, block_size, head_dim = kv_cache.shape
    flat = jnp.pad(states.astype(kv_cache.dtype),
                   [(0, 0), (0, n * page_values(kv_cache) - states.shape[1])])
    rows = flat.reshape(batch, n, two, heads, block_size, head_dim)
    pages = jnp.moveaxis(jnp.moveaxis(rows, 1, 3), 0, 2)  # [2, K, B, n, S, Hc]
    return kv_cache.at[:, :, tables].set(pages, mode="promise_in_bounds")
