"""Ragged paged attention for TPU (chunked prefill and mixed batches): Pallas, Mosaic lowering.

Axis letters as in tpu/decode.py; T tokens, BQ query tokens per tile, NT tiles.

The tiling is the GPU kernel's (common.tile_layout): each sequence's query tokens are cut
into tiles of BQ starting at its first token; grid (NT, K). The tile table, cu_q_lens and kv_lens
are scalar-prefetched; a program copies its sequence's block-table row from HBM into SMEM
(tpu.pipeline.fetch_table_row) and DMAs its BQ query rows from HBM, then walks the
sequence's pages up to the tile's last position, C pages per compute block with double-buffered
DMAs, and writes its own output tile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pagedjax.pallas_kernels.common import tile_layout, tpu_interpret_params
from pagedjax.pallas_kernels.tpu.pipeline import (SUBLANES, PagePipeline, attend_sequence,
                                                  check_operands, compiler_params, compute_dtype,
                                                  default_pages_per_step, fetch_table_row,
                                                  flat_tables, padded_heads, page_scratch,
                                                  sink_operands, table_width)


def _ragged_kernel(
    tile_seq_ref,  # i32[NT]           SMEM; -1 for spare tiles
    tile_start_ref,  # i32[NT]         SMEM; first token of each tile
    cu_q_lens_ref,  # i32[B + 1]       SMEM
    kv_lens_ref,  # i32[B]             SMEM
    tables_hbm_ref,  # i32[B * Pp]     HBM, flattened block tables
    q_hbm_ref,  # [T + BQ, K, Gp, H]   HBM (ANY)
    kv_hbm_ref,  # [2, K, NB, S, H]    HBM (ANY)
    *refs,  # [scales f32[2, K, NB, Ss] HBM,] [sinks f32[BQ * Gp, 1] VMEM,] o f32[BQ, Gp, H]
    #         VMEM output tile, then scratch:
    #         table_row i32[Pp] SMEM, q_buf [BQ, Gp, H], kv_buf [2, 2, C, S, H] (+ scale
    #         buffer [2, 2, C, Ss]) VMEM, table_sem, q_sem, page_sems DMA
    tile_q: int, pages_per_step: int, scale: float,
    sliding_window: int | None, soft_cap: float | None, quantized: bool, has_sinks: bool,
):
    scales_hbm_ref, refs = (refs[0], refs[1:]) if quantized else (None, refs)
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    o_ref, table_row, q_buf, *buffers, table_sem, q_sem, page_sems = refs
    tile, head = pl.program_id(0), pl.program_id(1)
    block_size, head_dim = kv_hbm_ref.shape[3], kv_hbm_ref.shape[4]
    group = q_buf.shape[1]
    block_k = pages_per_step * block_size
    num_rows = tile_q * group
    seq = jnp.maximum(tile_seq_ref[tile], 0)
    live = tile_seq_ref[tile] >= 0
    start = tile_start_ref[tile]
    q_first, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    offset = kv_lens_ref[seq] - (q_end - q_first)  # position of the sequence's first query
    last_pos = offset + jnp.minimum(start + tile_q, q_end) - 1 - q_first
    first_block: int | jax.Array = 0
    first_key: int | jax.Array = 0
    if sliding_window is not None:
        # The first key the tile's first query sees: pages before it may be back in the pool.
        first_key = offset + start - q_first - sliding_window + 1
        first_block = jax.lax.div(  # non-negative: see tpu/decode.py on floor division
            jnp.maximum(first_key, 0), block_k)
    num_blocks = jnp.where(live, pl.cdiv(last_pos + 1, block_k), 0)
    fetch_table_row(tables_hbm_ref, seq, table_row, table_sem, head)
    pipeline = PagePipeline(kv_hbm_ref, scales_hbm_ref, buffers, page_sems, table_row,
                            head=head, pages_per_step=pages_per_step)

    q_copy = pltpu.make_async_copy(q_hbm_ref.at[pl.ds(start, tile_q), head], q_buf, q_sem)
    q_copy.start()
    pipeline.start_first_block(first_block, num_blocks)

    q_copy.wait()
    dtype = compute_dtype(kv_hbm_ref.dtype, q_buf.dtype)
    q = q_buf[...].reshape(num_rows, head_dim).astype(dtype)
    row_token = start + jax.lax.broadcasted_iota(jnp.int32, (tile_q, group, 1), 0).reshape(
        num_rows, 1)
    row_live = (row_token < q_end) & live
    q_pos = offset + row_token - q_first  # [rows, 1]

    def key_live(pos):  # keys any row of the tile may see; past them pages may hold anything
        return (pos <= last_pos) & (pos >= first_key)

    def visible(pos):  # [rows, n]: causal, within the window, live rows only
        seen = (pos <= q_pos) & row_live
        if sliding_window is not None:
            seen &= pos > q_pos - sliding_window
        return seen

    o = attend_sequence(pipeline, q, first_block, num_blocks, block_k, dtype, key_live=key_live,
                        visible=visible, scale=scale, soft_cap=soft_cap,
                        sliding_window=sliding_window,
                        sinks=None if sinks_ref is None else sinks_ref[...])
    o_ref[...] = o.reshape(tile_q, group, head_dim)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "tile_q", "pages_per_step", "interpret",
    "value_dim"))
def ragged_paged_attention_tpu(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, H], this step's K/V already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    cu_q_lens: jax.Array,  # i32[B + 1]
    num_seqs: jax.Array,  # i32[]
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, tile_q: int = 16, pages_per_step: int | None = None,
    interpret: bool = False, value_dim: int | None = None,
) -> jax.Array:  # [T, N, H]; 0 for padding tokens ([.., value_dim]: a latent cache)
    """sinks: f32[N] attention sinks (pallas_kernels.reference), or None. value_dim: a latent
    cache (one plane, pallas_kernels.layout), attended with its whole rows as the values and
    its first value_dim columns of the output kept."""
    data, scales, group = check_operands(q, kv_cache)
    out_dim = q.shape[-1] if value_dim is None else value_dim
    q = padded_heads(q, data.shape[4])
    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, _ = data.shape
    padded_group = pl.cdiv(group, SUBLANES) * SUBLANES if group > 1 else 1
    width = block_tables.shape[1]
    pages_per_step = min(pages_per_step or default_pages_per_step(block_size), width)
    padded_width = table_width(width, pages_per_step)
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tile_seq, tile_start, token_tile, token_row = tile_layout(cu_q_lens, num_seqs, num_tokens,
                                                              tile_q)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    qg = jnp.pad(qg, ((0, tile_q), (0, 0), (0, padded_group - group), (0, 0)))
    num_tiles = tile_seq.shape[0]

    kernel = functools.partial(
        _ragged_kernel, tile_q=tile_q, pages_per_step=pages_per_step, scale=scale,
        sliding_window=sliding_window, soft_cap=soft_cap, quantized=scales is not None,
        has_sinks=sinks is not None)
    quant_operands = [] if scales is None else [scales]
    sink_inputs, sink_specs = sink_operands(sinks, num_kv_heads, group, padded_group, tile_q)
    tiles = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,  # tile_seq, tile_start, cu_q_lens, kv_lens
            grid=(num_tiles, num_kv_heads),
            in_specs=[pl.BlockSpec(memory_space=pltpu.HBM),  # block tables: a row per tile
                      pl.BlockSpec(memory_space=pl.ANY),  # q: rows DMA'd per tile
                      pl.BlockSpec(memory_space=pl.ANY)]  # kv_cache stays in HBM
            + [pl.BlockSpec(memory_space=pl.ANY)] * len(quant_operands)  # scales, in HBM
            + sink_specs,
            out_specs=pl.BlockSpec((None, tile_q, None, padded_group, head_dim),
                                   lambda t, h, *_: (t, 0, h, 0, 0)),
            scratch_shapes=[
                pltpu.SMEM((padded_width,), jnp.int32),  # the tile's block-table row
                pltpu.VMEM((tile_q, padded_group, head_dim), q.dtype),  # this tile's queries
                *page_scratch(pages_per_step, block_size, head_dim, data, scales),
                pltpu.SemaphoreType.DMA(()),  # table-row DMA
                pltpu.SemaphoreType.DMA(()),  # query DMA
                pltpu.SemaphoreType.DMA((2,)),  # page DMAs, one per buffer slot
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(
            (num_tiles, tile_q, num_kv_heads, padded_group, head_dim), jnp.float32),
        compiler_params=compiler_params(),
        interpret=tpu_interpret_params(interpret),
        name="ragged_paged_attention_tpu",
    )(tile_seq, tile_start, cu_q_lens, kv_lens.astype(jnp.int32),
      flat_tables(block_tables, padded_width), qg, data, *quant_operands, *sink_inputs)
    out = tiles[token_tile, token_row][:, :, :group]  # [T, K, G, H]
    live = jnp.arange(num_tokens) < cu_q_lens[num_seqs]
    out = jnp.where(live[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim)[..., :out_dim].astype(q.dtype)
