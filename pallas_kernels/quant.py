"""Quantized KV cache: int8 or fp8 (e4m3) values with one f32 scale per token and KV head.

A layer's quantized cache is QuantizedKV(data i8|f8[2, K, NB, S, Hc], scales f32[2, K, NB, Ss]),
Ss = S, or S padded to whole lane tiles on the TPU (layout.scale_lanes): both share the leading
[2, K, NB] axes, so block copies, swaps and gathers index them alike.
Per-token scales keep appends cheap: writing a token never requantizes its block.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

# The largest magnitude each quantized type holds: a row's max maps onto it.
QUANT_MAX = {np.dtype(np.int8): 127.0, np.dtype(ml_dtypes.float8_e4m3fn): 448.0}


def is_quantized(dtype) -> bool:
    return np.dtype(dtype) in QUANT_MAX


class QuantizedKV(NamedTuple):
    data: jax.Array  # i8|f8[2, K, NB, S, Hc]
    scales: jax.Array  # f32[2, K, NB, Ss]: token j of a page at [..., j]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def dtype(self):
        return self.data.dtype


def quantize(x: jax.Array, dtype=jnp.int8) -> tuple[jax.Array, jax.Array]:
    """Symmetric over the last axis: x ~= data * scale[..., None], data of dtype."""
    limit = QUANT_MAX[np.dtype(dtype)]
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / limit
    scale = jnp.where(scale > 0, scale, 1.0)
    y = x / scale[..., None]
    if jnp.issubdtype(dtype, jnp.integer):
        y = jnp.round(y)
    return jnp.clip(y, -limit, limit).astype(dtype), scale


def dequantize(data: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
    return (data.astype(jnp.float32) * scales[..., None]).astype(dtype)
