"""The Triton KV-cache write: the step's new K/V into their slots, in place on the donated cache.

The cache is both an input and the aliased output (input_output_aliases), left in HBM
(memory_space ANY), so only the slots written are touched: under a jit that donates the cache, no
copy of the pool is made. layout.write_kv_reference (an XLA scatter) is its reference, and writes
quantized caches.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pagedjax.pallas_kernels.gpu.triton.tiling import check_triton_shapes
from pagedjax.pallas_kernels.layout import write_kv_reference
from pagedjax.pallas_kernels.quant import QuantizedKV


def _write_kernel_gpu(slots_ref, k_ref, v_ref, _cache_in_ref, cache_ref, *, block_size: int):
    token = pl.program_id(0)
    slot = slots_ref[token]
    block, offset = jax.lax.div(slot, block_size), jax.lax.rem(slot, block_size)  # slot >= 0
    for head in range(cache_ref.shape[1]):  # one row of Hc per KV head
        cache_ref[0, head, block, offset, :] = k_ref[token, head, :]
        cache_ref[1, head, block, offset, :] = v_ref[token, head, :]


def _pad_to_cache(x: jax.Array, kv_cache: jax.Array) -> jax.Array:
    x = x.astype(kv_cache.dtype)
    return jnp.pad(x, ((0, 0), (0, 0), (0, kv_cache.shape[-1] - x.shape[-1])))


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_gpu(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block
    *, interpret: bool = False,
) -> jax.Array:
    """One program per token (Triton lowering); the cache is updated in place. A quantized
    cache is written by the XLA scatter (it quantizes as it writes)."""
    if isinstance(kv_cache, QuantizedKV):
        return write_kv_reference(kv_cache, k, v, slot_mapping)
    check_triton_shapes(block_size=kv_cache.shape[3], head_dim=kv_cache.shape[-1])
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel_gpu, block_size=kv_cache.shape[3]),
        grid=(k.shape[0],),
        in_specs=[any_spec] * 4,  # slot_mapping, k, v, kv_cache
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={3: 0},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_kv_gpu",
    )(slot_mapping.astype(jnp.int32), _pad_to_cache(k, kv_cache), _pad_to_cache(v, kv_cache),
      kv_cache)
