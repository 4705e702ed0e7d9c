"""Multi-head latent attention for GPU (DeepSeek's absorbed form): Pallas, Triton lowering.

A latent cache (pallas_kernels.layout) has one plane [1, 1, NB, S, Dl + R]: each token's latent
(Dl = value_dim, DeepSeek's kv_lora_rank 512) then its RoPE key (R, 64), unpadded. Triton's
tensors have power-of-two dims, so a program reads a page's rows as two tiles, [.., :Dl] and
[.., Dl:], instead of padding the row 576 -> 1,024 (78% more bytes a token read and held): the
scores are q_lat c^T + q_pe k_pe^T, the values the latent tile itself (loaded once, both dots
read it). Every query head attends to the one KV head (MQA), so a program takes a tile of
heads (and, in the ragged kernel, of query tokens) as the rows of its dots; DeepSeek-V3's 128
heads are 8 programs of 16 that read the same pages (from L2 after the first).

Axis letters: B sequences, T tokens, N query heads (Np: padded), Dl latent, R RoPE dims, S block
size, C pages a loop step, X splits, HT heads a program, BQ tokens a program, NT tiles.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pagedjax.pallas_kernels.common import MASK_VALUE, online_softmax_step, tile_layout
from pagedjax.pallas_kernels.gpu.common import combine_splits, next_power_of_2, split_context
from pagedjax.pallas_kernels.gpu.triton.tiling import (MAX_TILE_ELEMENTS, MIN_DOT_SIZE,
                                                       check_triton_shapes, fit_pipeline,
                                                       split_cache)


def _latent_pages(kv_ref, scales_ref, blocks, value_dim: int, dtype):
    """A loop step's latent rows [C*S, Dl] and RoPE keys [C*S, R] (dequantized for int8 / fp8:
    one scale a token for its whole row)."""
    block_size, row = kv_ref.shape[3], kv_ref.shape[4]
    rows = blocks.shape[0] * block_size
    c = kv_ref[0, 0, blocks, :, pl.ds(0, value_dim)].reshape(rows, value_dim)
    k_pe = kv_ref[0, 0, blocks, :, pl.ds(value_dim, row - value_dim)].reshape(
        rows, row - value_dim)
    if scales_ref is None:
        return c, k_pe
    scales = scales_ref[0, 0, blocks].reshape(rows)[:, None]
    return ((c.astype(jnp.float32) * scales).astype(dtype),
            (k_pe.astype(jnp.float32) * scales).astype(dtype))


def _attend_pages(q_lat, q_pe, kv_ref, scales_ref, table_ref, seq, *, first_page, num_steps,
                  pages_per_step: int, value_dim: int, visible_fn, scale: float):
    """The online softmax of rows (q_lat [Rw, Dl], q_pe [Rw, R]) over num_steps steps of
    pages_per_step pages from first_page: (o f32[Rw, Dl], m, l). visible_fn(kv_pos) -> a
    [Rw, keys]-broadcastable mask and the keys' [keys] liveness (V is zeroed past it)."""
    block_size = kv_ref.shape[3]
    block_k = pages_per_step * block_size

    def body(i, carry):
        page = first_page + i * pages_per_step
        blocks = table_ref[seq, pl.ds(page, pages_per_step)]  # i32[C]
        c, k_pe = _latent_pages(kv_ref, scales_ref, blocks, value_dim, q_lat.dtype)
        kv_pos = page * block_size + jnp.arange(block_k, dtype=jnp.int32)
        visible, live = visible_fn(kv_pos)
        v = jnp.where(live[:, None], c, jnp.zeros_like(c))  # see decode.py: NaN past kv_len
        return online_softmax_step(q_lat, c, v, visible, carry, scale=scale, soft_cap=None,
                                   rope=(q_pe, k_pe))

    rows = q_lat.shape[0]
    init = (jnp.zeros((rows, value_dim), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    return jax.lax.fori_loop(0, num_steps, body, init)


def _decode_kernel(kv_lens_ref, block_tables_ref,  # (ANY) i32[B], i32[B, Pp]
                   q_lat_ref, q_pe_ref,  # [HT, Dl], [HT, R]: this program's heads
                   kv_ref,  # [1, 1, NB, S, Dl + R] (ANY)
                   *refs,  # [scales f32[1, 1, NB, S] (ANY),] o f32[HT, Dl], l f32[HT], m f32[HT]
                   pages_per_split: int, pages_per_step: int, value_dim: int, scale: float,
                   quantized: bool):
    scales_ref, (o_ref, l_ref, m_ref) = (refs[0], refs[1:]) if quantized else (None, refs)
    seq, split = pl.program_id(0), pl.program_id(2)
    block_size = kv_ref.shape[3]
    kv_len = kv_lens_ref[seq]
    first_page = split * pages_per_split
    end_page = jnp.minimum((split + 1) * pages_per_split, pl.cdiv(kv_len, block_size))
    end = jnp.minimum(kv_len, end_page * block_size)

    def visible(kv_pos):
        live = kv_pos < end
        return live[None, :], live

    num_steps = pl.cdiv(jnp.maximum(end_page - first_page, 0), pages_per_step)
    o, m, l = _attend_pages(q_lat_ref[...], q_pe_ref[...], kv_ref, scales_ref, block_tables_ref,
                            seq, first_page=first_page, num_steps=num_steps,
                            pages_per_step=pages_per_step, value_dim=value_dim,
                            visible_fn=visible, scale=scale)
    o_ref[...] = o
    l_ref[...] = l
    m_ref[...] = m


def _ragged_kernel(tile_seq_ref, tile_start_ref, cu_q_lens_ref, kv_lens_ref,  # (ANY) i32
                   block_tables_ref,  # i32[B, Pp] (ANY)
                   q_lat_ref, q_pe_ref,  # [T + BQ, Np, Dl], [T + BQ, Np, R] (ANY)
                   kv_ref,  # [1, 1, NB, S, Dl + R] (ANY)
                   *refs,  # [scales (ANY),] o f32[BQ, HT, Dl] (this tile's tokens and heads)
                   tile_q: int, pages_per_step: int, value_dim: int, scale: float,
                   quantized: bool):
    scales_ref, (o_ref,) = (refs[0], refs[1:]) if quantized else (None, refs)
    tile, heads = pl.program_id(0), pl.program_id(1)
    block_size = kv_ref.shape[3]
    head_tile = o_ref.shape[1]
    num_rows = tile_q * head_tile
    seq = tile_seq_ref[tile]
    live = seq >= 0
    seq = jnp.maximum(seq, 0)
    start, q_start = tile_start_ref[tile], cu_q_lens_ref[seq]
    q_end = cu_q_lens_ref[seq + 1]
    offset = kv_lens_ref[seq] - (q_end - q_start)  # the chunk's first position
    token = start + jnp.arange(num_rows, dtype=jnp.int32) // head_tile
    row_live = (token < q_end) & live
    q_pos = offset + token - q_start
    last_pos = offset + jnp.minimum(start + tile_q, q_end) - 1 - q_start

    def visible(kv_pos):
        mask = (kv_pos[None, :] <= q_pos[:, None]) & row_live[:, None]
        return mask, kv_pos <= last_pos

    end_page = jnp.where(live, pl.cdiv(last_pos + 1, block_size), 0)
    rows = (pl.ds(start, tile_q), pl.ds(heads * head_tile, head_tile))
    q_lat = q_lat_ref[rows].reshape(num_rows, value_dim)
    q_pe = q_pe_ref[rows].reshape(num_rows, q_pe_ref.shape[2])
    o, _, l = _attend_pages(q_lat, q_pe, kv_ref, scales_ref, block_tables_ref, seq,
                            first_page=0, num_steps=pl.cdiv(end_page, pages_per_step),
                            pages_per_step=pages_per_step, value_dim=value_dim,
                            visible_fn=visible, scale=scale)
    o = jnp.where(l[:, None] > 0, o / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    o_ref[...] = o.reshape(tile_q, head_tile, value_dim)


def check_latent_shapes(q, kv_cache, value_dim: int, interpret: bool, **tunables):
    """(data, scales or None, compute dtype) of a latent cache the kernels read, refused by
    name where its layout or dims do not fit Triton's tiles: one plane of one KV head, a row of
    q's width, latent and RoPE dims powers of two >= 16."""
    data, scales, dtype = split_cache(kv_cache, q.dtype, interpret)
    planes, kv_heads, _, block_size, row = data.shape
    if planes != 1 or kv_heads != 1:
        raise ValueError(f"a latent cache has one plane of one KV head, got {planes} planes of "
                         f"{kv_heads} heads")
    if q.shape[-1] != row:
        raise ValueError(f"the query's width {q.shape[-1]} must equal the latent cache's row "
                         f"{row} (latent + RoPE dims, unpadded on the GPU layout)")
    if (problem := latent_dims_problem(value_dim, row - value_dim)) is not None:
        raise ValueError(f"the GPU latent kernels cannot read this cache: {problem}")
    check_triton_shapes(block_size=block_size, head_dim=value_dim, **tunables)
    return data, scales, dtype


def choose_tiles(num_heads: int, value_dim: int, tokens: int = 1) -> tuple[int, int, int]:
    """(padded heads Np, heads a program HT, tokens a program BQ): the rows HT x BQ of a
    program's dots at most MAX_TILE_ELEMENTS // Dl (16 at DeepSeek's 512: a 16 x 512 f32
    accumulator, as the GQA kernels' 64 x 128), at least MIN_DOT_SIZE; BQ <= tokens."""
    padded = next_power_of_2(max(num_heads, MIN_DOT_SIZE))
    budget = max(MIN_DOT_SIZE, MAX_TILE_ELEMENTS // value_dim)
    head_tile = min(padded, budget)
    return padded, head_tile, max(1, min(tokens, budget // head_tile))


def _split_query(q, value_dim: int, padded_heads: int, dtype, pad_tokens: int = 0):
    pad = ((0, pad_tokens), (0, padded_heads - q.shape[1]), (0, 0))
    return (jnp.pad(q[..., :value_dim].astype(dtype), pad),
            jnp.pad(q[..., value_dim:].astype(dtype), pad))


def _fit(pages_per_step, num_stages, *, preferred_pages, rows, data, dtype, scales, row, width):
    pages, stages = fit_pipeline(
        pages_per_step, num_stages, preferred_pages=preferred_pages, rows=rows,
        block_size=data.shape[3], head_dim=row, cache_itemsize=data.dtype.itemsize,
        compute_itemsize=jnp.dtype(dtype).itemsize, quantized=scales is not None, planes=1)
    return min(pages, next_power_of_2(width)), stages


@functools.partial(jax.jit, static_argnames=(
    "scale", "value_dim", "pages_per_step", "num_splits", "num_warps", "num_stages",
    "interpret"))
def latent_decode_attention_gpu(
    q: jax.Array,  # [B, N, Dl + R]: q_nope W_UK, then q_pe
    kv_cache: jax.Array,  # [1, 1, NB, S, Dl + R], this step's rows already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    num_seqs: jax.Array,  # i32[]
    *, scale: float, value_dim: int, pages_per_step: int | None = None,
    num_splits: int | None = None, num_warps: int = 8, num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [B, N, Dl]; 0 for padding rows
    """Split-K decode over a latent cache (as gpu.triton.paged_decode_attention_gpu: grid
    (B, Np // HT, X), splits merged outside); sizing as there, one plane a stage."""
    batch, num_heads, row = q.shape
    data, scales, dtype = check_latent_shapes(q, kv_cache, value_dim, interpret,
                                              pages_per_step=pages_per_step)
    padded_heads, head_tile, _ = choose_tiles(num_heads, value_dim)
    width = block_tables.shape[1]
    pages_per_step, num_stages = _fit(pages_per_step, num_stages, preferred_pages=8,
                                      rows=head_tile, data=data, dtype=dtype, scales=scales,
                                      row=row, width=width)
    head_tiles = padded_heads // head_tile
    num_splits, pages_per_split, tables, lens = split_context(
        block_tables, kv_lens, num_seqs, programs=batch * head_tiles,
        pages_per_step=pages_per_step, num_splits=num_splits)
    q_lat, q_pe = _split_query(q, value_dim, padded_heads, dtype)
    kernel = functools.partial(_decode_kernel, pages_per_split=pages_per_split,
                               pages_per_step=pages_per_step, value_dim=value_dim, scale=scale,
                               quantized=scales is not None)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    quant = [] if scales is None else [scales]
    stats_spec = pl.BlockSpec((None, None, head_tile), lambda b, h, s: (s, b, h))
    stats = jax.ShapeDtypeStruct((num_splits, batch, padded_heads), jnp.float32)
    o, l, m = pl.pallas_call(
        kernel,
        grid=(batch, head_tiles, num_splits),
        in_specs=[any_spec, any_spec,
                  pl.BlockSpec((None, head_tile, value_dim), lambda b, h, s: (b, h, 0)),
                  pl.BlockSpec((None, head_tile, row - value_dim), lambda b, h, s: (b, h, 0)),
                  any_spec] + [any_spec] * len(quant),
        out_specs=[pl.BlockSpec((None, None, head_tile, value_dim),
                                lambda b, h, s: (s, b, h, 0)), stats_spec, stats_spec],
        out_shape=[jax.ShapeDtypeStruct((num_splits, batch, padded_heads, value_dim),
                                        jnp.float32), stats, stats],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="latent_decode_attention_gpu",
    )(lens, tables, q_lat, q_pe, data, *quant)
    return combine_splits(o, l, m)[:, :num_heads].astype(q.dtype)


@functools.partial(jax.jit, static_argnames=(
    "scale", "value_dim", "tile_q", "pages_per_step", "num_warps", "num_stages", "interpret"))
def latent_ragged_attention_gpu(
    q: jax.Array,  # [T, N, Dl + R]
    kv_cache: jax.Array,  # [1, 1, NB, S, Dl + R], this step's rows already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    cu_q_lens: jax.Array,  # i32[B + 1]
    num_seqs: jax.Array,  # i32[]
    *, scale: float, value_dim: int, tile_q: int | None = None,
    pages_per_step: int | None = None, num_warps: int = 8, num_stages: int | None = None,
    interpret: bool = False,
) -> jax.Array:  # [T, N, Dl]; 0 for padding tokens
    """Chunked prefill and mixed batches over a latent cache (as
    gpu.triton.ragged_paged_attention_gpu: tiles of BQ tokens of one sequence, grid
    (NT, Np // HT)); tile_q None: as many tokens as choose_tiles gives rows for."""
    num_tokens, num_heads, row = q.shape
    data, scales, dtype = check_latent_shapes(q, kv_cache, value_dim, interpret, tile_q=tile_q,
                                              pages_per_step=pages_per_step)
    padded_heads, head_tile, chosen = choose_tiles(num_heads, value_dim, tokens=16)
    tile_q = chosen if tile_q is None else tile_q
    width = block_tables.shape[1]
    pages_per_step, num_stages = _fit(pages_per_step, num_stages, preferred_pages=4,
                                      rows=tile_q * head_tile, data=data, dtype=dtype,
                                      scales=scales, row=row, width=width)
    padded_width = (pl.cdiv(width, pages_per_step) + 1) * pages_per_step
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tile_seq, tile_start, token_tile, token_row = tile_layout(cu_q_lens, num_seqs, num_tokens,
                                                              tile_q)
    q_lat, q_pe = _split_query(q, value_dim, padded_heads, dtype, pad_tokens=tile_q)
    num_tiles = tile_seq.shape[0]
    kernel = functools.partial(_ragged_kernel, tile_q=tile_q, pages_per_step=pages_per_step,
                               value_dim=value_dim, scale=scale, quantized=scales is not None)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    quant = [] if scales is None else [scales]
    tiles = pl.pallas_call(
        kernel,
        grid=(num_tiles, padded_heads // head_tile),
        # tile_seq, tile_start, cu_q_lens, kv_lens, tables, q_lat, q_pe, cache[, scales]
        in_specs=[any_spec] * (8 + len(quant)),
        out_specs=pl.BlockSpec((None, tile_q, head_tile, value_dim), lambda t, h: (t, 0, h, 0)),
        out_shape=jax.ShapeDtypeStruct((num_tiles, tile_q, padded_heads, value_dim),
                                       jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="latent_ragged_attention_gpu",
    )(tile_seq, tile_start, cu_q_lens, kv_lens.astype(jnp.int32), tables, q_lat, q_pe, data,
      *quant)
    out = tiles[token_tile, token_row][:, :num_heads]  # [T, N, Dl]
    live = jnp.arange(num_tokens) < cu_q_lens[num_seqs]
    return jnp.where(live[:, None, None], out, 0.0).astype(q.dtype)


def check_latent_options(**options) -> None:
    """What the latent kernels do not take (no MLA model has them), refused by name."""
    for name, value in options.items():
        if value is not None:
            raise ValueError(f"the GPU latent (MLA) kernels take no {name}, got {value!r}")


def latent_dims_problem(value_dim: int, rope_dims: int) -> str | None:
    """Why the GPU latent kernels cannot take a model's latent and RoPE dims, or None."""
    for name, dim in (("kv_lora_rank", value_dim), ("qk_rope_head_dim", rope_dims)):
        if dim < MIN_DOT_SIZE or dim & (dim - 1):
            return f"{name} {dim} is not a power of two >= {MIN_DOT_SIZE}"
    return None
