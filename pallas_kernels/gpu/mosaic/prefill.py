"""Ragged paged attention for Hopper GPUs (chunked prefill, mixed steps): Pallas with the Mosaic GPU
lowering.

The kernel takes tiles of R // Gp query tokens x the GQA group Gp (a power of two) as its R rows,
never spanning two sequences (common.tile_layout), attends causally inside the chunk and fully to
the cached prefix with attend_pages (gpu/mosaic/attend.py), and writes its normalised tile, which
the wrapper gathers back into token order. The wrapper gathers each tile's query rows first
([NT, K, R, Hc]), so a tile's rows are one TMA copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pagedjax.pallas_kernels.common import tile_layout
from pagedjax.pallas_kernels.gpu.common import next_power_of_2
from pagedjax.pallas_kernels.gpu.mosaic.attend import attend_pages, load_queries, pipeline, scratch
from pagedjax.pallas_kernels.gpu.mosaic.common import ROWS, check_operands, interpret_params


def _ragged_kernel(tile_seq_ref, tile_start_ref, cu_q_lens_ref, lens_ref, tables_ref, q_ref,
                   kv_ref, o_ref, q_smem, k_smem, v_smem, p_smem, o_smem, q_barrier,
                   kv_barriers, *, group_shift: int, pages_per_step: int, num_stages: int,
                   scale: float, sliding_window: int | None, soft_cap: float | None):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    tile, head = jax.lax.axis_index("tile"), jax.lax.axis_index("head")
    block_size = kv_ref.shape[3]
    rows, head_dim = q_smem.shape
    tile_q = rows >> group_shift
    seq = tile_seq_ref[tile]
    live = seq >= 0
    seq = jnp.maximum(seq, 0)
    start = tile_start_ref[tile]
    q_begin, q_end = cu_q_lens_ref[seq], cu_q_lens_ref[seq + 1]
    kv_len = lens_ref[seq]
    offset = kv_len - (q_end - q_begin)  # the position of the chunk's first token
    last_pos = offset + jnp.minimum(start + tile_q, q_end) - 1 - q_begin
    first_page = jnp.int32(0)
    if sliding_window is not None:
        first_page = jnp.maximum(offset + start - q_begin - sliding_window + 1, 0) // block_size
    end_page = jnp.where(live, (last_pos + block_size) // block_size, 0)
    num_steps = (jnp.maximum(end_page - first_page, 0) + pages_per_step - 1) // pages_per_step

    # Row r holds token start + r // Gp of the tile; rows past the sequence's last token see
    # nothing (their last visible position is -1). Per-row values are kept as row vectors and
    # broadcast: [R, keys] int32 tiles cost 64 registers a thread each.
    token = start + jax.lax.shift_right_logical(
        plgpu.broadcasted_iota(jnp.int32, (rows,), 0, layout=plgpu.Layout.WGMMA.reduce(1)),
        jnp.int32(group_shift))
    q_pos = jnp.where(token < q_end, offset + token - q_begin, -1)

    def visible_fn(pos):
        visible = pos <= jax.lax.broadcast_in_dim(q_pos, pos.shape, [0])
        if sliding_window is not None:
            visible &= pos > jax.lax.broadcast_in_dim(q_pos - sliding_window, pos.shape, [0])
        return visible

    load_queries(q_ref.at[tile, head], q_smem, q_barrier)
    acc, _, l = attend_pages(
        tables_ref, kv_ref, k_smem, v_smem, p_smem, q_smem, q_barrier, kv_barriers, seq=seq,
        head=head, first_page=first_page, num_steps=num_steps, visible_fn=visible_fn,
        v_lo=jnp.int32(0), v_hi=last_pos + 1, pages_per_step=pages_per_step,
        num_stages=num_stages, scale=scale, soft_cap=soft_cap)
    safe_l = jnp.where(l > 0, l, 1.0)
    o_smem[...] = jnp.where(jax.lax.broadcast_in_dim(l > 0, acc.shape, [0]),
                            acc / jax.lax.broadcast_in_dim(safe_l, acc.shape, [0]), 0.0)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_ref.at[tile, head])
    plgpu.wait_smem_to_gmem(0)


@functools.partial(jax.jit, static_argnames=(
    "scale", "sliding_window", "soft_cap", "pages_per_step", "num_stages", "interpret"))
def ragged_paged_attention_mosaic_gpu(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, Hc] bf16 or f16, this step's K/V already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    cu_q_lens: jax.Array,  # i32[B + 1]
    num_seqs: jax.Array,  # i32[]
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    pages_per_step: int | None = None, num_stages: int | None = None, interpret=False,
) -> jax.Array:  # [T, N, H]; 0 for padding tokens
    """A tile is R // Gp query tokens (16 at GQA 4, 64 for MHA); pages_per_step / num_stages as
    in paged_decode_attention_mosaic_gpu."""
    group = check_operands(q, kv_cache)
    from jax.experimental.pallas import mosaic_gpu as plgpu

    num_tokens, num_heads, head_dim = q.shape
    _, num_kv_heads, _, block_size, cache_head_dim = kv_cache.shape
    padded_group = next_power_of_2(group)
    rows = max(ROWS, padded_group)
    tile_q = rows // padded_group
    width = block_tables.shape[1]
    pages_per_step, num_stages = pipeline(pages_per_step, num_stages, rows=rows,
                                          kv_cache=kv_cache)
    padded_width = (-(-width // pages_per_step) + 1) * pages_per_step
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, padded_width - width)))
    cu_q_lens = cu_q_lens.astype(jnp.int32)
    tile_seq, tile_start, token_tile, token_row = tile_layout(cu_q_lens, num_seqs, num_tokens,
                                                              tile_q)
    num_tiles = tile_seq.shape[0]
    # [NT, K, R, Hc]: each tile's rows (tokens x group) gathered, so that a program's TMA copy
    # starts at a tile boundary (Mosaic GPU must prove a copy's row offset is a multiple of its
    # 8-row tiles; a tile starts at any token).
    qg = q.reshape(num_tokens, num_kv_heads, group, head_dim).astype(kv_cache.dtype)
    qg = jnp.pad(qg, ((0, tile_q), (0, 0), (0, padded_group - group),
                      (0, cache_head_dim - head_dim)))
    qt = qg[tile_start[:, None] + jnp.arange(tile_q, dtype=jnp.int32)[None]]
    qt = qt.transpose(0, 2, 1, 3, 4).reshape(num_tiles, num_kv_heads, rows, cache_head_dim)

    kernel = functools.partial(
        _ragged_kernel, group_shift=padded_group.bit_length() - 1,
        pages_per_step=pages_per_step, num_stages=num_stages, scale=scale,
        sliding_window=sliding_window, soft_cap=soft_cap)
    tiles = plgpu.kernel(
        kernel,
        out_type=jax.ShapeDtypeStruct((num_tiles, num_kv_heads, rows, cache_head_dim),
                                      jnp.float32),
        scratch_types=scratch(rows=rows, keys=pages_per_step * block_size,
                              head_dim=cache_head_dim, dtype=kv_cache.dtype,
                              num_stages=num_stages, pages_per_step=pages_per_step,
                              softmax_stats=False),
        grid=(num_tiles, num_kv_heads),
        grid_names=("tile", "head"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
        interpret=interpret_params(interpret),
        kernel_name="ragged_paged_attention_mosaic_gpu",
    )(tile_seq, tile_start, cu_q_lens, kv_lens.astype(jnp.int32), tables, qt, kv_cache)
    tiles = tiles.reshape(num_tiles, num_kv_heads, tile_q, padded_group, cache_head_dim)
    out = tiles[token_tile, :, token_row][:, :, :group, :head_dim]  # [T, K, G, H]
    live = jnp.arange(num_tokens) < cu_q_lens[num_seqs]
    out = jnp.where(live[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_heads, head_dim).astype(q.dtype)
