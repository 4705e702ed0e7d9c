"""Ragged paged attention for GPU (chunked prefill and mixed batches): Pallas, Triton lowering.

Axis letters as in decode.py; T tokens, BQ query tokens per tile, NT tiles.

Each sequence's query tokens (cu_q_lens) are cut into tiles of BQ tokens, starting at the
sequence's first token, so a tile never spans two sequences. Grid (NT, K) with
NT = cdiv(T, BQ) + B, an upper bound on the tile count; spare programs exit at once. A program
takes its BQ tokens x G query heads as the rows of one dot, walks the sequence's blocks up to its
last token's position (causal within the chunk, full attention to the cached prefix), and writes
its own output tile, which the wrapper gathers back into token order: no two programs write the
same memory, and no masked stores are needed.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pagedjax.pallas_kernels.common import MASK_VALUE, online_softmax_step, sink_rows, tile_layout
from pagedjax.pallas_kernels.gpu.common import next_power_of_2
from pagedjax.pallas_kernels.gpu.triton import latent
from pagedjax.pallas_kernels.gpu.triton.tiling import (MAX_TILE_ELEMENTS, MIN_DOT_SIZE,
                                                       check_operands, fit_pipeline, load_pages)


def _ragged_kernel(
    tile_seq_ref,  # i32[NT]              (ANY) sequence of each tile; -1 for spare tiles
    tile_start_ref,  # i32[NT]            (ANY) first token of each tile
    cu_q_lens_ref,  # i32[B + 1]          (ANY)
    kv_lens_ref,  # i32[B]                (ANY)
    block_tables_ref,  # i32[B, Pp]       (ANY)
    q_ref,  # [T + BQ, K, Gp, Hp]         (ANY)
    kv_ref,  # [2, K, NB, S, Hp]          (ANY)
    *refs,  # [scales f32[2, K, NB, S] (ANY) if quantized,] [sinks f32[Gp] (this head's),]
    #         o f32[BQ, Gp, Hp] (this tile)
    tile_q: int, pages_per_step: int, scale: float, sliding_window: int | None,
    soft_cap: float | None, quantized: bool, has_sinks: bool,
):
    scales_ref, refs = (refs[0], refs[1:]) if quantized else (None, refs)
    sinks_ref, refs = (refs[0], refs[1:]) if has_sinks else (None, refs)
    o_ref, = refs
    tile, head = pl.program_id(0), pl.program_id(1)
    block_size, head_dim = kv_ref.shape[3], kv_ref.shape[4]
    group = q_ref.shape[2]
    block_k = pages_per_step * block_size
    num_rows = tile_q * group
    seq = tile_seq_ref[tile]
    live = seq >= 0
    seq = jnp.maximum(seq, 0)
    start = tile_start_ref[tile]
    q_end = cu_q_lens_ref[seq + 1]
    kv_len = kv_lens_ref[seq]
    # Absolute position of each row's token; rows past the sequence's last token are dead.
    offset = kv_len - (q_end - cu_q_lens_ref[seq])
    token = start + jnp.arange(num_rows, dtype=jnp.int32) // group
    row_live = (token < q_end) & live
    q_pos = offset + token - cu_q_lens_ref[seq]
    last_pos = offset + jnp.minimum(start + tile_q, q_end) - 1 - cu_q_lens_ref[seq]
    first_page = 0
    if sliding_window is not None:
        first_page = jnp.maximum(offset + start - cu_q_lens_ref[seq] - sliding_window + 1,
                                 0) // block_size
    end_page = jnp.where(live, pl.cdiv(last_pos + 1, block_size), 0)
    q = q_ref[pl.ds(start, tile_q), head].reshape(num_rows, head_dim)

    def body(i, carry):
        page = first_page + i * pages_per_step
        blocks = block_tables_ref[seq, pl.ds(page, pages_per_step)]
        k = load_pages(kv_ref, scales_ref, 0, head, blocks, q.dtype)
        v = load_pages(kv_ref, scales_ref, 1, head, blocks, q.dtype)
        kv_pos = page * block_size + jnp.arange(block_k, dtype=jnp.int32)
        col_live = kv_pos <= last_pos
        v = jnp.where(col_live[:, None], v, jnp.zeros_like(v))  # K: see decode.py
        visible = (kv_pos[None, :] <= q_pos[:, None]) & row_live[:, None]
        if sliding_window is not None:
            visible &= kv_pos[None, :] > q_pos[:, None] - sliding_window
        return online_softmax_step(q, k, v, visible, carry, scale=scale, soft_cap=soft_cap)

    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_step)
    m0 = jnp.full((num_rows,), MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((num_rows,), jnp.float32)
    if sinks_ref is not None:  # a logit with no value: the max starts at it, the sum at 1
        m0 = jnp.broadcast_to(sinks_ref[...][None, :], (tile_q, group)).reshape(num_rows)
        l0 = jnp.ones((num_rows,), jnp.float32)
    init = (jnp.zeros((num_rows, head_dim), jnp.float32), m0, l0)
    o, _, l = jax.lax.fori_loop(0, num_steps, body, init)
    o = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    o_ref[...] = o.reshape(tile_q, group, head_dim)



def choose_tile_q(padded_group: int, padded_head_dim: int, preferred: int = 16) -> int:
    """Query tokens a program takes: halved while the tile is larger than MAX_TILE_ELEMENTS,
    as long as the rows still fill a dot (at head dim 256 with a group of 8, 16 tokens spill
    registers on every chip)."""
    tile_q = preferred
    while (tile_q * padded_group * padded_head_dim > MAX_TILE_ELEMENTS
           and (tile_q // 2) * padded_group >= MIN_DOT_SIZE):
        tile_q //= 2
    return tile_q


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "tile_q", "pages_per_step", "num_warps",
    "num_stages", "interpret", "value_dim"))
def ragged_paged_attention_gpu(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, Hp], this step's K/V already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    cu_q_lens: jax.Array,  # i32[B + 1]
    num_seqs: jax.Array,  # i32[]
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, tile_q: int | None = None,
    pages_per_step: int | None = None, num_warps: int = 8, num_stages: int | None = None,
    interpret: bool = False, value_dim: int | None = None,
) -> jax.Array:  # [T, N, H] ([T, N, value_dim]: a latent cache); 0 for padding tokens
    """sinks: f32[N] attention sinks (pallas_kernels.reference) or None. tile_q None: up to
    16 query tokens a program, fewer when the GQA group and head dim make the rows x head dim
    tile larger than MAX_TILE_ELEMENTS (see choose_tile_q).
    pages_per_step / num_stages None: up to 4 pages per loop step and 2 stages, as many as fit
    the GPU's shared memory (see gpu.triton.fit_pipeline); an explicit value is taken as given.
    8 warps: with 4, a tile of 16 tokens x a GQA group of 4 needs 223 registers a thread on
    sm_90 and spills on sm_80 (benchmarks/results/gpu_compile.md). value_dim: a latent cache
    (gpu.triton.latent)."""
    if value_dim is not None:
        latent.check_latent_options(sliding_window=sliding_window, soft_cap=soft_cap,
                                    sinks=sinks)
        return latent.latent_ragged_attention_gpu(
            q, kv_cache, kv_lens, block_tables, cu_q_lens, num_seqs, scale=scale,
            value_dim=value_dim, tile_q=tile_q, pages_per_step=pages_per_step,
            num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    num_tokens, num_heads, head_dim = q.shape
    data, scales, dtype, group = check_operands(q, kv_cache, interpret, tile_q=tile_q,
                                                pages_per_step=pages_per_step)
    _, num_kv_heads, _, block_size, padded_head_dim = data.shape
    padded_group = next_power_of_2(group)
    width = block_tables.shape[1]
    if tile_q is None:
        tile_q = choose_tile_q(padded_group, padded_head_dim)
    pages_per_step, num_stages = fit_pipeline(
        pages_per_step, num_stages, preferred_pages=4, rows=tile_q * padded_group,
        block_size=block_size, head_dim=padded_head_dim, cache_itemsize=data.dtype.itemsize,
        compute_itemsize=jnp.dtype(dtype).itemsize, quantized=scales is not None)
    pages_per_step = min(pages_per_step, next_power_of_2(width))
    padded_width = (pl.cdiv(width, pages_per_step) + 1) * pages_per_step
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tile_seq, tile_start, token_tile, token_row = tile_layout(cu_q_lens, num_seqs, num_tokens,
                                                              tile_q)
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(dtype)
    qg = jnp.pad(qg, ((0, tile_q), (0, 0), (0, padded_group - group),
                      (0, padded_head_dim - head_dim)))
    num_tiles = tile_seq.shape[0]

    kernel = functools.partial(
        _ragged_kernel, tile_q=tile_q, pages_per_step=pages_per_step, scale=scale,
        sliding_window=sliding_window, soft_cap=soft_cap, quantized=scales is not None,
        has_sinks=sinks is not None)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    quant_operands = [] if scales is None else [scales]
    sink_inputs, sink_specs = [], []
    if sinks is not None:
        sink_inputs = [sink_rows(sinks, num_kv_heads, group, padded_group)]
        sink_specs = [pl.BlockSpec((None, padded_group), lambda t, h: (h, 0))]
    tiles = pl.pallas_call(
        kernel,
        grid=(num_tiles, num_kv_heads),
        # tile_seq, tile_start, cu_q_lens, kv_lens, tables, q, cache[, scales]
        in_specs=[any_spec] * (7 + len(quant_operands)) + sink_specs,
        out_specs=pl.BlockSpec((None, tile_q, None, padded_group, padded_head_dim),
                               lambda t, h: (t, 0, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(
            (num_tiles, tile_q, num_kv_heads, padded_group, padded_head_dim), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(tile_seq, tile_start, cu_q_lens, kv_lens.astype(jnp.int32), tables, qg, data,
      *quant_operands, *sink_inputs)
    out = tiles[token_tile, token_row][:, :, :group, :head_dim]  # [T, K, G, H]
    live = jnp.arange(num_tokens) < cu_q_lens[num_seqs]
    out = jnp.where(live[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
