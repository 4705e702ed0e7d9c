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
from pagedjax.pallas_kernels.layout import planes_of, write_kv_reference
from pagedjax.pallas_kernels.quant import QuantizedKV


def _write_kernel_gpu(slots_ref, *refs, block_size: int, chunks: tuple):
    *new_refs, _cache_in_ref, cache_ref = refs  # one new-row operand a plane (K, V or a latent)
    token = pl.program_id(0)
    slot = slots_ref[token]
    block, offset = jax.lax.div(slot, block_size), jax.lax.rem(slot, block_size)  # slot >= 0
    for plane, new_ref in enumerate(new_refs):
        for head in range(cache_ref.shape[1]):  # one row of Hc per KV head
            for start, size in chunks:
                cache_ref[plane, head, block, offset, pl.ds(start, size)] = (
                    new_ref[token, head, pl.ds(start, size)])


def row_chunks(width: int) -> tuple[tuple[int, int], ...]:
    """(start, size) of a row in power-of-two pieces, largest first (Triton's tensors): a
    power-of-two row whole, a latent row 576 as 512 + 64."""
    chunks, start = [], 0
    for bit in reversed(range(width.bit_length())):
        if width & (1 << bit):
            chunks.append((start, 1 << bit))
            start += 1 << bit
    return tuple(chunks)


def _pad_to_cache(x: jax.Array, kv_cache: jax.Array) -> jax.Array:
    x = x.astype(kv_cache.dtype)
    return jnp.pad(x, ((0, 0), (0, 0), (0, kv_cache.shape[-1] - x.shape[-1])))


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_gpu(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc]
    k: jax.Array,  # [T, K, H]
    v: jax.Array | None,  # [T, K, H]; None: a latent cache [1, 1, NB, S, Hc] (one plane)
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block
    *, interpret: bool = False,
) -> jax.Array:
    """One program per token (Triton lowering); the cache is updated in place. A quantized
    cache is written by the XLA scatter (it quantizes as it writes). A latent row, whose width
    is no power of two (unpadded: pallas_kernels.layout), is stored in row_chunks."""
    if isinstance(kv_cache, QuantizedKV):
        return write_kv_reference(kv_cache, k, v, slot_mapping)
    width = kv_cache.shape[-1]
    check_triton_shapes(block_size=kv_cache.shape[3], head_dim=width if v is not None else 1)
    new = [_pad_to_cache(x, kv_cache) for x in planes_of(k, v)]
    if len(new) != kv_cache.shape[0]:
        raise ValueError(f"a cache of {kv_cache.shape[0]} planes takes "
                         f"{kv_cache.shape[0]} new-row operands, got {len(new)}")
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel_gpu, block_size=kv_cache.shape[3],
                          chunks=row_chunks(width)),
        grid=(k.shape[0],),
        in_specs=[any_spec] * (2 + len(new)),  # slot_mapping, the new rows, kv_cache
        out_specs=any_spec,
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={1 + len(new): 0},
        compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
        interpret=interpret,
        name="write_kv_gpu",
    )(slot_mapping.astype(jnp.int32), *new, kv_cache)
