"""Grouped LoRA shrink and expand for GPU (issue 53): Pallas with the Triton lowering, fused
(SGMV): the step's tokens sorted by adapter slot and laid out in tiles of ROW_TILE rows that each
hold one slot's tokens (a slot's run padded to whole tiles); one program a (tile, output chunk)
reads its slot's a once, shrinks its rows to [rows, R] in f32 in registers, and expands them by
its chunk of b: the [T, R] intermediate never reaches memory. Tiles past the slots' runs, and
base tokens (sorted past every slot), compute nothing but zeros.

Needs what Triton's dots need: R a power of two >= 16, I a multiple of K_TILE and O of
N_TILE (check_gpu_shapes; pallas_kernels.lora falls back to "masked" otherwise).

Axis letters: T tokens, I a projection's input, O its output, S slots, R max_lora_rank.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pagedjax.pallas_kernels.common import sort_by_slot

ROW_TILE, K_TILE, N_TILE = 16, 64, 64  # Triton's dots: every dimension a power of two >= 16


def gpu_shapes_fit(inputs: int, outputs: int, rank: int) -> bool:
    """Whether the kernel takes these shapes (else the masked reference runs)."""
    return (rank >= 16 and rank & (rank - 1) == 0 and inputs % K_TILE == 0
            and outputs % N_TILE == 0)


def _lora_kernel(tile_slots_ref,  # i32[NT]            (ANY) each tile's slot, -1: none
                 x_ref,  # [NT * ROW_TILE, I]          (ANY) the tokens in slot tiles
                 a_ref,  # [S, I, R]                   (ANY)
                 b_ref,  # [S, R, O]                   (ANY)
                 o_ref,  # f32[ROW_TILE, N_TILE]       this program's block
                 *, num_k: int):
    tile, column = pl.program_id(0), pl.program_id(1)
    slot = tile_slots_ref[tile]
    safe = jnp.maximum(slot, 0)
    first_row = tile * ROW_TILE
    rank = a_ref.shape[2]

    def shrink(k, acc):
        rows = x_ref[pl.ds(first_row, ROW_TILE), pl.ds(k * K_TILE, K_TILE)]  # [tm, tk]
        a = a_ref[safe, pl.ds(k * K_TILE, K_TILE), :]  # [tk, R]
        return acc + jnp.dot(rows, a, preferred_element_type=jnp.float32)

    shrunk = jax.lax.fori_loop(0, num_k, shrink, jnp.zeros((ROW_TILE, rank), jnp.float32))
    b = b_ref[safe, :, pl.ds(column * N_TILE, N_TILE)]  # [R, tn]
    out = jnp.dot(shrunk.astype(b.dtype), b, preferred_element_type=jnp.float32)
    o_ref[...] = jnp.where(slot >= 0, out, 0.0)


def slot_tiles(token_slots: jax.Array, num_slots: int, tile: int):
    """The tiled layout: (src i32[NT * tile]: the token each row holds, -1 for padding;
    tile_slots i32[NT]: each tile's slot, -1 past the runs; row_of i32[T]: each token's row).
    NT = ceil(T / tile) + S bounds the tiles whatever the split."""
    num_tokens = token_slots.shape[0]
    num_tiles = -(-num_tokens // tile) + num_slots
    order, sizes = sort_by_slot(token_slots, num_slots)
    starts = jnp.cumsum(sizes) - sizes  # each run's first sorted position
    padded = -(-sizes // tile) * tile
    padded_ends = jnp.cumsum(padded)
    rows = jnp.arange(num_tiles * tile, dtype=jnp.int32)
    group = jnp.searchsorted(padded_ends, rows, side="right").astype(jnp.int32)  # S: past
    safe = jnp.minimum(group, num_slots - 1)
    offset = rows - (padded_ends[safe] - padded[safe])
    inside = (group < num_slots) & (offset < sizes[safe])
    src = jnp.where(inside, order[jnp.minimum(starts[safe] + offset, num_tokens - 1)], -1)
    tile_slots = jnp.where(group[::tile] < num_slots, group[::tile], -1)
    row_of = jnp.zeros(num_tokens, jnp.int32).at[jnp.where(src >= 0, src, num_tokens)].set(
        rows, mode="drop")
    return src, tile_slots, row_of


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def lora_delta_gpu(x: jax.Array,  # [T, I]
                   a: jax.Array,  # [S, I, R]
                   b: jax.Array,  # [S, R, O]
                   token_slots: jax.Array,  # i32[T], -1: none
                   *, num_warps: int = 4, interpret: bool = False) -> jax.Array:  # f32[T, O]
    """pallas_kernels.lora.lora_delta's "gpu" implementation (shapes: gpu_shapes_fit)."""
    num_slots, inputs, rank = a.shape
    outputs = b.shape[2]
    if not gpu_shapes_fit(inputs, outputs, rank):
        raise ValueError(f"the GPU LoRA kernel needs rank a power of two >= 16, inputs a "
                         f"multiple of {K_TILE} and outputs of {N_TILE}; got {rank=}, "
                         f"{inputs=}, {outputs=}")
    src, tile_slots, row_of = slot_tiles(token_slots, num_slots, ROW_TILE)
    rows = jnp.where((src >= 0)[:, None], x[jnp.maximum(src, 0)], 0).astype(a.dtype)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        functools.partial(_lora_kernel, num_k=inputs // K_TILE),
        grid=(tile_slots.shape[0], outputs // N_TILE),
        in_specs=[any_spec, any_spec, any_spec, any_spec],
        out_specs=pl.BlockSpec((ROW_TILE, N_TILE), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows.shape[0], outputs), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="lora_sgmv_gpu",
    )(tile_slots, rows, a, b)
    return jnp.where((token_slots >= 0)[:, None], out[row_of], 0.0)
