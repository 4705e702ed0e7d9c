"""The Mosaic GPU KV-cache write: the step's K/V into their slots in place, one program a token."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pagedjax.pallas_kernels.gpu.mosaic.common import check_cache, interpret_params, problem


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_mosaic_gpu(
    kv_cache: jax.Array,  # [2, K, NB, S, Hc] bf16 or f16
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block
    *, interpret=False,
) -> jax.Array:
    """The step's K/V into their slots, in place: one program a token copies its K and V rows
    (TMA) into shared memory and from there into its slot under every KV head. The kernel
    mutates the cache as a Ref (pl.kernel under pl.run_state), so the cache is the custom
    call's aliased output; under a jit that donates it no copy of the pool is made."""
    if (reason := problem()) is not None:
        raise ValueError(reason)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    check_cache(kv_cache, k.shape[-1])
    _, num_kv_heads, _, block_size, cache_head_dim = kv_cache.shape
    pad = ((0, 0), (0, 0), (0, cache_head_dim - k.shape[-1]))
    k, v = (jnp.pad(x.astype(kv_cache.dtype), pad) for x in (k, v))
    mesh = plgpu.Mesh(grid=(k.shape[0],), grid_names=("token",))

    def stateful(refs):
        cache_ref, k_ref, v_ref, slots_ref = refs

        def _write():
            token = jax.lax.axis_index("token")
            slot = slots_ref[token]
            block = jax.lax.div(slot, block_size)  # slot >= 0
            offset = jax.lax.rem(slot, block_size)

            def copy(kv_smem, barrier):
                plgpu.copy_gmem_to_smem(k_ref.at[token], kv_smem.at[0], barrier)
                plgpu.copy_gmem_to_smem(v_ref.at[token], kv_smem.at[1], barrier)
                plgpu.barrier_wait(barrier)
                # [K, Hc]: a row per KV head, NB x S x Hc apart in the cache.
                plgpu.copy_smem_to_gmem(kv_smem.at[0], cache_ref.at[0, :, block, offset])
                plgpu.copy_smem_to_gmem(kv_smem.at[1], cache_ref.at[1, :, block, offset])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(copy, plgpu.SMEM((2, num_kv_heads, cache_head_dim), kv_cache.dtype),
                          plgpu.Barrier(num_arrivals=2))

        pl.kernel(_write, out_type=(), mesh=mesh, compiler_params=plgpu.CompilerParams(),
                  interpret=interpret_params(interpret), name="write_kv_mosaic_gpu")()

    cache, *_ = pl.run_state(stateful)((kv_cache, k, v, slot_mapping.astype(jnp.int32)))
    return cache
