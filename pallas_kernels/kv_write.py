"""Pallas KV-cache writes: the step's new K/V into their slots, in place on the donated cache.

The cache is both an input and the aliased output (input_output_aliases), passed with
memory_space=ANY, so only the written slots are touched; under a jit that donates the cache, no
copy of the pool is made. write_kv_reference (an XLA scatter) is the reference for both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.layout import NULL_BLOCK, write_kv_reference
from pallas_kernels.quant import QuantizedKV
from pallas_kernels.tpu_decode import interpret_params


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


ROW_TILE = 8  # rows of an f32 tile in TPU memory
MAX_WRITE_TOKENS = 65536  # 3 x 4 bytes a token of run table in SMEM (1 MB on v5e)


def page_runs(slot_mapping: jax.Array, block_size: int):
    """Cuts the step's tokens into runs: consecutive tokens at consecutive slots of one page.
    Tokens in the null block (padding) belong to no run: nobody reads what is written there.

    Returns (num_runs i32[], and per run, padded to T: first token, length, slot of the first
    token), every one i32[T]."""
    num_tokens = slot_mapping.shape[0]
    page = jax.lax.div(slot_mapping, block_size)
    offset = jax.lax.rem(slot_mapping, block_size)
    live = page != NULL_BLOCK
    prev_page = jnp.concatenate([jnp.full((1,), -1, jnp.int32), page[:-1]])
    prev_offset = jnp.concatenate([jnp.full((1,), -2, jnp.int32), offset[:-1]])
    starts = live & ((page != prev_page) | (offset != prev_offset + 1))
    run_of_token = jnp.where(live, jnp.cumsum(starts) - 1, num_tokens)
    lengths = jnp.zeros(num_tokens, jnp.int32).at[run_of_token].add(1, mode="drop")
    first = jnp.nonzero(starts, size=num_tokens, fill_value=0)[0].astype(jnp.int32)
    return jnp.sum(starts).astype(jnp.int32), first, lengths, slot_mapping[first]


def _write_kernel_tpu(num_runs_ref, first_ref, length_ref, slot_ref,  # SMEM
                      k_hbm_ref, v_hbm_ref,  # f32[K, T + S, H] HBM: the new rows, head-major
                      _cache_in_ref, cache_ref,  # [2, K, NB, S, H] HBM, aliased
                      page_buf, new_buf, sems):  # VMEM [2, K, S, H], f32[2, K, S + 8, H], DMA[4]
    run = pl.program_id(0)

    @pl.when(run < num_runs_ref[0])
    def _():
        _, num_kv_heads, block_size, head_dim = page_buf.shape
        first, slot = first_ref[run], slot_ref[run]
        page, offset = jax.lax.div(slot, block_size), jax.lax.rem(slot, block_size)
        # Whole pages only: a DMA into a bf16 page at a row offset is not aligned to the
        # (packed) tiling, so the run's page is read, updated in VMEM and written back.
        reads = [pltpu.make_async_copy(cache_ref.at[i, :, page], page_buf.at[i], sems.at[i])
                 for i in (0, 1)]
        # The new rows from a window starting at a multiple of 8 (a DMA source must start on
        # a tile row once a row spans more than one lane tile, as at head dim 256).
        lead = jax.lax.rem(first, ROW_TILE)
        window = pl.ds(pl.multiple_of(first - lead, ROW_TILE), block_size + ROW_TILE)
        reads += [pltpu.make_async_copy(src.at[:, window], new_buf.at[i], sems.at[2 + i])
                  for i, src in enumerate((k_hbm_ref, v_hbm_ref))]
        for copy in reads:
            copy.start()
        for copy in reads:
            copy.wait()
        # Page row r takes window row r - offset + lead, for offset <= r < offset + length.
        row = jax.lax.broadcasted_iota(jnp.int32, (num_kv_heads, block_size, head_dim), 1)
        inside = (row >= offset) & (row < offset + length_ref[run])
        shift = jax.lax.rem(offset - lead + block_size + ROW_TILE, block_size + ROW_TILE)
        for i in (0, 1):
            moved = pltpu.roll(new_buf[i], shift, 1)[:, :block_size]
            page_buf[i] = jnp.where(inside, moved, page_buf[i].astype(jnp.float32)).astype(
                page_buf.dtype)
        writes = [pltpu.make_async_copy(page_buf.at[i], cache_ref.at[i, :, page], sems.at[i])
                  for i in (0, 1)]
        for copy in writes:
            copy.start()
        for copy in writes:
            copy.wait()


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_tpu(
    kv_cache: jax.Array,  # [2, K, NB, S, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block
    *, interpret: bool = False,
) -> jax.Array:
    """One program per run of tokens in one page (Mosaic, run boundaries scalar-prefetched):
    the page's K and V are read into VMEM, the run's rows put in place and the pages written
    back, in place on the aliased HBM cache. Runs of the same page are taken in order (the grid
    is sequential). A quantized cache is written by the XLA scatter (it quantizes as it
    writes)."""
    if isinstance(kv_cache, QuantizedKV):
        return write_kv_reference(kv_cache, k, v, slot_mapping)
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    runs = page_runs(slot_mapping.astype(jnp.int32), block_size)

    if k.shape[0] > MAX_WRITE_TOKENS:
        raise ValueError(f"the TPU KV write takes at most {MAX_WRITE_TOKENS} tokens a step (its "
                         f"run table lives in SMEM), got {k.shape[0]}: lower "
                         "max_num_batched_tokens")
    if block_size % ROW_TILE:
        raise ValueError(f"the TPU KV write needs a block size that is a multiple of {ROW_TILE}, "
                         f"got block_size={block_size}")

    def head_major(x):  # f32[K, T + S + 8, H]: every run's window of S + 8 rows exists
        x = jnp.pad(x.astype(jnp.float32), ((0, block_size + ROW_TILE), (0, 0), (0, 0)))
        return x.transpose(1, 0, 2)

    # HBM, not ANY: a small input under ANY may be placed in VMEM, where a window at an
    # unaligned row is no DMA source (MQA at head dim 256 did that).
    hbm_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    return pl.pallas_call(
        _write_kernel_tpu,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # num_runs, first, length, first slot
            grid=(k.shape[0],),  # at most one run per token
            in_specs=[hbm_spec] * 3,  # new K, new V, kv_cache
            out_specs=hbm_spec,
            scratch_shapes=[
                pltpu.VMEM((2, num_kv_heads, block_size, head_dim), kv_cache.dtype),
                pltpu.VMEM((2, num_kv_heads, block_size + ROW_TILE, head_dim), jnp.float32),
                pltpu.SemaphoreType.DMA((4,)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={6: 0},  # operand 6 counts the four scalar-prefetch operands
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret_params(interpret),
        name="write_kv_tpu",
    )(runs[0].reshape(1), *runs[1:], head_major(k), head_major(v), kv_cache)
