"""Quantized KV cache: int8 values with one f32 scale per token and KV head.

A layer's quantized cache is QuantizedKV(data i8[2, K, NB, S, Hc], scales f32[2, K, NB, S]):
both share the leading [2, K, NB, S] axes, so block copies, swaps and gathers index them alike.
Per-token scales keep appends cheap: writing a token never requantizes its block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

INT8_MAX = 127.0


class QuantizedKV(NamedTuple):
    data: jax.Array  # i8[2, K, NB, S, Hc]
    scales: jax.Array  # f32[2, K, NB, S]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 over the last axis: x ~= data * scale[..., None]."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / INT8_MAX
    scale = jnp.where(scale > 0, scale, 1.0)
    data = jnp.clip(jnp.round(x / scale[..., None]), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return data, scale


def dequantize(data: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (data.astype(jnp.float32) * scales[..., None]).astype(dtype)
