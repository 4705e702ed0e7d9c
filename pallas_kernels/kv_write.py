"""Pallas KV-cache writes: the step's new K/V into their slots, in place on the donated cache.

The cache is both an input and the aliased output (input_output_aliases), left in HBM
(memory_space ANY on the GPU, HBM on the TPU), so only what is written is touched: the slots on
the GPU, the pages holding them on the TPU (a bf16 row is no aligned DMA there, so pages are
rewritten whole). Under a jit that donates the cache, no copy of the pool is made.
write_kv_reference (an XLA scatter) is the reference for both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.gpu_decode import check_triton_shapes
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


ROW_TILE = 8  # rows of an f32 tile in TPU memory
MAX_WRITE_TOKENS = 65536  # 3 x 4 bytes a token of page table in SMEM (1 MB on v5e)
PAGES_PER_PROGRAM = 8  # pages whose DMAs one program keeps in flight together


def page_groups(slot_mapping: jax.Array, block_size: int):
    """Orders the step's tokens by slot and groups them by page, so each page is rewritten by
    exactly one program. Tokens in the null block (padding) are dropped (nobody reads what is
    written there), and of tokens sharing a slot the last one is kept, as a scatter would.

    Returns (order i32[T]: token indices, kept ones first in slot order; num_pages i32[];
    per page, padded to T: its first kept token's position in `order`, its token count; and
    the slot of each position in `order`)."""
    num_tokens = slot_mapping.shape[0]
    positions = jnp.arange(num_tokens, dtype=jnp.int32)
    live = jax.lax.div(slot_mapping, block_size) != NULL_BLOCK
    by_slot = jnp.lexsort((positions, jnp.where(live, slot_mapping, jnp.iinfo(jnp.int32).max)))
    sorted_slot = slot_mapping[by_slot]
    superseded = jnp.concatenate([sorted_slot[1:] == sorted_slot[:-1], jnp.zeros(1, bool)])
    keep = live[by_slot] & ~superseded
    order = by_slot[jnp.argsort(~keep, stable=True)].astype(jnp.int32)
    num_kept = jnp.sum(keep)
    slots = slot_mapping[order]
    page = jax.lax.div(slots, block_size)
    starts = (positions < num_kept) & ((positions == 0) | (page != jnp.roll(page, 1)))
    page_of = jnp.where(positions < num_kept, jnp.cumsum(starts) - 1, num_tokens)
    counts = jnp.zeros(num_tokens, jnp.int32).at[page_of].add(1, mode="drop")
    first = jnp.nonzero(starts, size=num_tokens, fill_value=0)[0].astype(jnp.int32)
    return order, jnp.sum(starts).astype(jnp.int32), first, counts, slots


def _write_kernel_tpu(num_pages_ref, first_ref, count_ref, slot_ref,  # SMEM
                      k_hbm_ref, v_hbm_ref,  # f32[K, T + S + 8, H] HBM: new rows in slot order
                      _cache_in_ref, cache_ref,  # [2, K, NB, S, H] HBM, aliased
                      page_buf, new_buf, sems):
    # page_buf [R, 2, K, S, H] and new_buf f32[R, 2, K, S + 8, H] VMEM, sems DMA[R, 4]
    pages_per_program, _, num_kv_heads, block_size, head_dim = page_buf.shape
    window_rows = new_buf.shape[3]

    def for_each_page(fn):
        for r in range(pages_per_program):
            index = pl.program_id(0) * pages_per_program + r

            @pl.when(index < num_pages_ref[0])
            def _():
                first = first_ref[index]
                fn(r, first, count_ref[index], jax.lax.div(slot_ref[first], block_size))

    def reads(r, first, page):
        # Whole pages only: a DMA into a bf16 page at a row offset is not aligned to the
        # (packed) tiling, so a page is read, updated in VMEM and written back. The new rows
        # come from a window that starts on a tile row (a DMA source must, once a row spans
        # more than one lane tile, as at head dim 256).
        window = pl.ds(pl.multiple_of(first - jax.lax.rem(first, ROW_TILE), ROW_TILE),
                       window_rows)
        return ([pltpu.make_async_copy(cache_ref.at[i, :, page], page_buf.at[r, i],
                                       sems.at[r, i]) for i in (0, 1)]
                + [pltpu.make_async_copy(src.at[:, window], new_buf.at[r, i], sems.at[r, 2 + i])
                   for i, src in enumerate((k_hbm_ref, v_hbm_ref))])

    def writes(r, page):
        return [pltpu.make_async_copy(page_buf.at[r, i], cache_ref.at[i, :, page],
                                      sems.at[r, i]) for i in (0, 1)]

    def update(r, first, count, page):
        row = jax.lax.broadcasted_iota(jnp.int32, (num_kv_heads, block_size, head_dim), 1)
        lead = jax.lax.rem(first, ROW_TILE)

        def put(j, pages):  # token first + j: window row lead + j goes to its page offset
            offset = jax.lax.rem(slot_ref[first + j], block_size)
            shift = jax.lax.rem(offset - lead - j + 2 * window_rows, window_rows)
            return tuple(
                jnp.where(row == offset, pltpu.roll(new_buf[r, i], shift, 1)[:, :block_size],
                          pages[i]) for i in (0, 1))

        pages = jax.lax.fori_loop(0, count, put, tuple(
            page_buf[r, i].astype(jnp.float32) for i in (0, 1)))
        for i in (0, 1):
            page_buf[r, i] = pages[i].astype(page_buf.dtype)

    for_each_page(lambda r, first, count, page: [c.start() for c in reads(r, first, page)])
    for_each_page(lambda r, first, count, page: [c.wait() for c in reads(r, first, page)])
    for_each_page(lambda r, first, count, page: update(r, first, count, page))
    for_each_page(lambda r, first, count, page: [c.start() for c in writes(r, page)])
    for_each_page(lambda r, first, count, page: [c.wait() for c in writes(r, page)])


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_tpu(
    kv_cache: jax.Array,  # [2, K, NB, S, H]
    k: jax.Array,  # [T, K, H]
    v: jax.Array,  # [T, K, H]
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block
    *, interpret: bool = False,
) -> jax.Array:
    """Mosaic. The step's tokens are grouped by page (page_groups); each program takes
    PAGES_PER_PROGRAM pages, with all their DMAs in flight together: the pages' K and V are read
    into VMEM, their new rows put in place and the pages written back, in place on the aliased
    HBM cache. No two programs touch one page, so the grid is parallel. A quantized cache is
    written by the XLA scatter (it quantizes as it writes)."""
    if isinstance(kv_cache, QuantizedKV):
        return write_kv_reference(kv_cache, k, v, slot_mapping)
    block_size = kv_cache.shape[3]
    num_tokens = k.shape[0]
    if num_tokens > MAX_WRITE_TOKENS:
        raise ValueError(f"the TPU KV write takes at most {MAX_WRITE_TOKENS} tokens a step (its "
                         f"page table lives in SMEM), got {num_tokens}: lower "
                         "max_num_batched_tokens")
    if block_size % ROW_TILE:
        raise ValueError(f"the TPU KV write needs a block size that is a multiple of {ROW_TILE}, "
                         f"got block_size={block_size}")
    order, *groups = page_groups(slot_mapping.astype(jnp.int32), block_size)
    return write_pages_tpu(kv_cache, k[order], v[order], *groups, interpret=interpret)


def write_pages_tpu(
    kv_cache: jax.Array,  # [2, K, NB, S, H]
    k: jax.Array,  # [T, K, H] in page_groups' order
    v: jax.Array,  # [T, K, H] in page_groups' order
    num_pages: jax.Array, first: jax.Array, counts: jax.Array, slots: jax.Array,  # page_groups
    *, interpret: bool = False,
) -> jax.Array:
    """write_kv_tpu's kernel, on tokens already grouped by page (page_groups, an XLA sort)."""
    _, num_kv_heads, _, block_size, head_dim = kv_cache.shape
    num_tokens = k.shape[0]

    def head_major(x):  # f32[K, T + S + 8, H] in slot order: every page's window of rows exists
        x = jnp.pad(x.astype(jnp.float32), ((0, block_size + ROW_TILE), (0, 0), (0, 0)))
        return x.transpose(1, 0, 2)

    # HBM, not ANY: a small input under ANY may be placed in VMEM, where a window at an
    # unaligned row is no DMA source (MQA at head dim 256 did that).
    hbm_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    pages = PAGES_PER_PROGRAM
    return pl.pallas_call(
        _write_kernel_tpu,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # num_pages, first, count, slots
            grid=(pl.cdiv(num_tokens, pages),),  # at most one page per token
            in_specs=[hbm_spec] * 3,  # new K, new V, kv_cache
            out_specs=hbm_spec,
            scratch_shapes=[
                pltpu.VMEM((pages, 2, num_kv_heads, block_size, head_dim), kv_cache.dtype),
                pltpu.VMEM((pages, 2, num_kv_heads, block_size + ROW_TILE, head_dim),
                           jnp.float32),
                pltpu.SemaphoreType.DMA((pages, 4)),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(kv_cache.shape, kv_cache.dtype),
        input_output_aliases={6: 0},  # operand 6 counts the four scalar-prefetch operands
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=interpret_params(interpret),
        name="write_kv_tpu",
    )(num_pages.reshape(1), first, counts, slots, head_major(k), head_major(v), kv_cache)
