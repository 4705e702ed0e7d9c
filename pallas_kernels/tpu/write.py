"""The TPU KV-cache writes and block copies (Mosaic), in place on the donated cache.

The cache is both an input and the aliased output (input_output_aliases), left in HBM, so only
the pages holding the step's slots are touched (a bf16 row is no aligned DMA on a TPU, so pages
are rewritten whole); under a jit that donates the cache, no copy of the pool is made.
layout.write_kv_reference (an XLA scatter) and layout.copy_blocks are their references.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pagedjax.pallas_kernels.common import tpu_interpret_params
from pagedjax.pallas_kernels.layout import LANES, NULL_BLOCK, planes_of
from pagedjax.pallas_kernels.quant import QuantizedKV, quantize
from pagedjax.pallas_kernels.tpu.pipeline import padded_heads

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
                      *refs, quantized: bool, planes: int):
    # refs: the new rows of each plane (K, V; a latent cache's one), f32[K, T + S + 8,
    # (Ss +) H] in HBM; the cache [P, K, NB, S, H] (and its scales f32[P, K, NB, Ss]) in HBM
    # as inputs, then the same, aliased, as outputs; then scratch: page_buf [R, P, K, S, H]
    # (and scale_buf f32[R, P, K, Ss]), new_buf f32[R, P, K, S + 8, (Ss +) H] VMEM, sems
    # DMA[R, 6].
    new_refs, refs = refs[:planes], refs[planes:]
    if quantized:
        _, _, cache_ref, scales_ref, page_buf, scale_buf, new_buf, sems = refs
    else:
        _, cache_ref, page_buf, new_buf, sems = refs
    pages_per_program, _, num_kv_heads, block_size, head_dim = page_buf.shape
    window_rows = new_buf.shape[3]
    scale_lanes = scale_buf.shape[-1] if quantized else 0

    def for_each_page(fn):
        for r in range(pages_per_program):
            index = pl.program_id(0) * pages_per_program + r

            @pl.when(index < num_pages_ref[0])  # traced now, in this iteration
            def _(r=r, index=index):
                first = first_ref[index]
                fn(r, first, count_ref[index], jax.lax.div(slot_ref[first], block_size))

    def reads(r, first, page):
        # Whole pages only: a DMA into a bf16 page at a row offset is not aligned to the
        # (packed) tiling, so a page is read, updated in VMEM and written back. The new rows
        # come from a window that starts on a tile row (a DMA source must, once a row spans
        # more than one lane tile, as at head dim 256).
        window = pl.ds(pl.multiple_of(first - jax.lax.rem(first, ROW_TILE), ROW_TILE),
                       window_rows)
        copies = ([pltpu.make_async_copy(cache_ref.at[i, :, page], page_buf.at[r, i],
                                         sems.at[r, i]) for i in range(planes)]
                  + [pltpu.make_async_copy(src.at[:, window], new_buf.at[r, i],
                                           sems.at[r, 2 + i])
                     for i, src in enumerate(new_refs)])
        if quantized:
            copies += [pltpu.make_async_copy(scales_ref.at[i, :, page], scale_buf.at[r, i],
                                             sems.at[r, 4 + i]) for i in range(planes)]
        return copies

    def writes(r, page):
        copies = [pltpu.make_async_copy(page_buf.at[r, i], cache_ref.at[i, :, page],
                                        sems.at[r, i]) for i in range(planes)]
        if quantized:
            copies += [pltpu.make_async_copy(scale_buf.at[r, i], scales_ref.at[i, :, page],
                                             sems.at[r, 4 + i]) for i in range(planes)]
        return copies

    def update(r, first, count, page):
        row = jax.lax.broadcasted_iota(jnp.int32, (num_kv_heads, block_size, head_dim), 1)
        lead = jax.lax.rem(first, ROW_TILE)
        if quantized:
            scale_row = jax.lax.broadcasted_iota(
                jnp.int32, (num_kv_heads, block_size, scale_lanes), 1)
            lane = jax.lax.broadcasted_iota(jnp.int32, (num_kv_heads, scale_lanes), 1)

        def put(j, carry):  # token first + j: window row lead + j goes to its page offset
            pages, scales = carry
            offset = jax.lax.rem(slot_ref[first + j], block_size)
            shift = jax.lax.rem(offset - lead - j + 2 * window_rows, window_rows)
            new_pages, new_scales = [], []
            for i in range(planes):
                rolled = pltpu.roll(new_buf[r, i], shift, 1)[:, :block_size]
                new_pages.append(jnp.where(row == offset, rolled[..., scale_lanes:], pages[i]))
                if quantized:  # the token's scale fills its row's first Ss lanes
                    token_scale = jnp.sum(jnp.where(scale_row == offset,
                                                    rolled[..., :scale_lanes], 0.0), axis=1)
                    new_scales.append(jnp.where(lane == offset, token_scale, scales[i]))
            return tuple(new_pages), tuple(new_scales)

        init = (tuple(page_buf[r, i].astype(jnp.float32) for i in range(planes)),
                tuple(scale_buf[r, i] for i in range(planes)) if quantized else ())
        pages, scales = jax.lax.fori_loop(0, count, put, init)
        for i in range(planes):
            page_buf[r, i] = pages[i].astype(page_buf.dtype)  # quantized: exact values
            if quantized:
                scale_buf[r, i] = scales[i]

    for_each_page(lambda r, first, count, page: [c.start() for c in reads(r, first, page)])
    for_each_page(lambda r, first, count, page: [c.wait() for c in reads(r, first, page)])
    for_each_page(lambda r, first, count, page: update(r, first, count, page))
    for_each_page(lambda r, first, count, page: [c.start() for c in writes(r, page)])
    for_each_page(lambda r, first, count, page: [c.wait() for c in writes(r, page)])


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def write_kv_tpu(
    kv_cache: jax.Array,  # [2, K, NB, S, H] ([1, ...]: a latent cache)
    k: jax.Array,  # [T, K, H]
    v: jax.Array | None,  # [T, K, H]; None for a latent cache (one plane)
    slot_mapping: jax.Array,  # i32[T]; padding tokens point into the null block
    *, interpret: bool = False,
) -> jax.Array | QuantizedKV:
    """Mosaic. The step's tokens are grouped by page (page_groups); each program takes
    PAGES_PER_PROGRAM pages, with all their DMAs in flight together: the pages' K and V are read
    into VMEM, their new rows put in place and the pages written back, in place on the aliased
    HBM cache. No two programs touch one page, so the grid is parallel. A quantized cache's
    new rows are quantized here (quant.quantize, as the XLA scatter does) and each carries its
    scale in front of its values, put into the page's scale row the same way; an XLA scatter
    would relayout the whole int8 pool and its scales every step (layout.py)."""
    data = kv_cache.data if isinstance(kv_cache, QuantizedKV) else kv_cache
    block_size = data.shape[3]
    num_tokens = k.shape[0]
    news = [padded_heads(x, data.shape[4]) for x in planes_of(k, v)]  # layout.cache_head_dim
    if num_tokens > MAX_WRITE_TOKENS:
        raise ValueError(f"the TPU KV write takes at most {MAX_WRITE_TOKENS} tokens a step (its "
                         f"page table lives in SMEM), got {num_tokens}: lower "
                         "max_num_batched_tokens")
    if block_size % ROW_TILE:
        raise ValueError(f"the TPU KV write needs a block size that is a multiple of {ROW_TILE}, "
                         f"got block_size={block_size}")
    if isinstance(kv_cache, QuantizedKV):
        scale_lanes = kv_cache.scales.shape[-1]
        if scale_lanes % LANES:
            raise ValueError(f"the TPU KV write needs scale rows of whole {LANES}-lane tiles "
                             f"(init_kv_cache(..., backend='tpu')), got {scale_lanes}")
        values, scales = quantize(jnp.stack(news), data.dtype)  # [P, T, K, H], f32[P, T, K]
        news = [jnp.concatenate([jnp.broadcast_to(scales[i][..., None],
                                                  (*scales[i].shape, scale_lanes)),
                                 values[i].astype(jnp.float32)], axis=-1)
                for i in range(len(news))]
    order, *groups = page_groups(slot_mapping.astype(jnp.int32), block_size)
    return write_pages_tpu(kv_cache, *(x[order] for x in news), *groups, interpret=interpret)


def write_pages_tpu(
    kv_cache: jax.Array,  # [P, K, NB, S, H] or a QuantizedKV
    *operands,  # each plane's new rows, [T, K, H] in page_groups' order (quantized: f32[T, K,
    #             Ss + H], see above): K and V, or a latent cache's one; then page_groups'
    #             num_pages, first, counts, slots
    interpret: bool = False,
) -> jax.Array | QuantizedKV:
    """write_kv_tpu's kernel, on tokens already grouped by page (page_groups, an XLA sort)."""
    quantized = isinstance(kv_cache, QuantizedKV)
    arrays = list(kv_cache) if quantized else [kv_cache]  # data (and scales)
    planes, num_kv_heads, _, block_size, head_dim = arrays[0].shape
    news, (num_pages, first, counts, slots) = operands[:planes], operands[planes:]
    num_tokens, _, row_width = news[0].shape

    def head_major(x):  # f32[K, T + S + 8, W] in slot order: every page's window of rows exists
        x = jnp.pad(x.astype(jnp.float32), ((0, block_size + ROW_TILE), (0, 0), (0, 0)))
        return x.transpose(1, 0, 2)

    # HBM, not ANY: a small input under ANY may be placed in VMEM, where a window at an
    # unaligned row is no DMA source (MQA at head dim 256 did that).
    hbm_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    pages = PAGES_PER_PROGRAM
    scale_scratch = ([pltpu.VMEM((pages, planes, num_kv_heads, arrays[1].shape[-1]),
                                 jnp.float32)] if quantized else [])
    out = pl.pallas_call(
        functools.partial(_write_kernel_tpu, quantized=quantized, planes=planes),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # num_pages, first, count, slots
            grid=(pl.cdiv(num_tokens, pages),),  # at most one page per token
            in_specs=[hbm_spec] * (planes + len(arrays)),  # new rows, the cache's arrays
            out_specs=[hbm_spec] * len(arrays),
            scratch_shapes=[
                pltpu.VMEM((pages, planes, num_kv_heads, block_size, head_dim),
                           arrays[0].dtype),
                *scale_scratch,
                pltpu.VMEM((pages, planes, num_kv_heads, block_size + ROW_TILE, row_width),
                           jnp.float32),
                pltpu.SemaphoreType.DMA((pages, 6)),
            ],
        ),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        # The cache's arrays, after the four scalar-prefetch operands and the new rows.
        input_output_aliases={4 + planes + i: i for i in range(len(arrays))},
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        interpret=tpu_interpret_params(interpret),
        name="write_kv_tpu",
    )(num_pages.reshape(1), first, counts, slots, *map(head_major, news), *arrays)
    return QuantizedKV(*out) if quantized else out[0]


def _copy_blocks_kernel_tpu(src_ref, dst_ref, num_ref,  # SMEM
                            *refs):  # the cache's arrays (inputs, aliased outputs), sems
    num_arrays = (len(refs) - 1) // 2
    outs, sems = refs[num_arrays:-1], refs[-1]

    def copies(i):  # block src[i] -> dst[i], HBM to HBM, in every array of the cache
        return [pltpu.make_async_copy(out.at[:, :, src_ref[i]], out.at[:, :, dst_ref[i]],
                                      sems.at[a]) for a, out in enumerate(outs)]

    def start(i, carry):
        for c in copies(i):
            c.start()
        return carry

    def wait(i, carry):
        for c in copies(i):
            c.wait()
        return carry

    jax.lax.fori_loop(0, num_ref[0], start, 0)  # all in flight at once, then waited on
    jax.lax.fori_loop(0, num_ref[0], wait, 0)


@functools.partial(jax.jit, static_argnames=("interpret",), donate_argnums=(0,))
def copy_blocks_tpu(
    kv_cache,  # [2, K, NB, S, H] or a QuantizedKV
    src: jax.Array,  # i32[C] blocks to copy from
    dst: jax.Array,  # i32[C] blocks to copy to; padding pairs are (0, 0)
    num_copies: jax.Array,  # i32[] only the first num_copies pairs are real
    *, interpret: bool = False,
):
    """Copy-on-write on the TPU: one HBM-to-HBM DMA a block and array, in place on the aliased
    cache, none when num_copies is 0. layout.copy_blocks (an XLA scatter) is the reference; on a
    quantized pool XLA relays the f32 scales out for it, a whole-pool copy a step. A copy's
    destination is a fresh block, never another copy's source, so all run at once."""
    quantized = isinstance(kv_cache, QuantizedKV)
    arrays = list(kv_cache) if quantized else [kv_cache]
    hbm_spec = pl.BlockSpec(memory_space=pltpu.HBM)
    out = pl.pallas_call(
        _copy_blocks_kernel_tpu,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,  # src, dst, num_copies
            grid=(1,),
            in_specs=[hbm_spec] * len(arrays),
            out_specs=[hbm_spec] * len(arrays),
            scratch_shapes=[pltpu.SemaphoreType.DMA((len(arrays),))],
        ),
        out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays],
        input_output_aliases={3 + i: i for i in range(len(arrays))},
        interpret=tpu_interpret_params(interpret),
        name="copy_blocks_tpu",
    )(src.astype(jnp.int32), dst.astype(jnp.int32), num_copies.astype(jnp.int32).reshape(1),
      *arrays)
    return QuantizedKV(*out) if quantized else out[0]
