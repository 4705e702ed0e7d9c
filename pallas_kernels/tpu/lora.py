"""Grouped LoRA shrink and expand for TPU (issue 53): the step's tokens sorted by adapter slot and
each slot's run of rows multiplied by its own pair with JAX's shipped grouped matmul (megablox
`gmm`, Pallas on Mosaic TPU), shrink [T, I] x a[s] -> [T, R] in f32, then expand
[T, R] x b[s] -> [T, O]. A tile of rows reads one slot's pair; slots without tokens and base
tokens (sorted past every group) cost nothing; rows outside the groups are masked at the end.

Axis letters: T tokens, I a projection's input, O its output, S slots, R max_lora_rank.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.megablox import gmm

from pagedjax.pallas_kernels.common import sort_by_slot

MAX_ROW_TILE = 128  # rows a tile (8-row multiples: a TPU sublane group)
K_TILE, N_TILE = 512, 512  # the contraction's and the output's tiles (128-lane multiples)


def _row_tile(num_tokens: int) -> int:
    return min(MAX_ROW_TILE, -(-num_tokens // 8) * 8)


@functools.partial(jax.jit, static_argnames=("interpret",))
def lora_delta_tpu(x: jax.Array,  # [T, I]
                   a: jax.Array,  # [S, I, R]
                   b: jax.Array,  # [S, R, O]
                   token_slots: jax.Array,  # i32[T], -1: none
                   *, interpret: bool = False) -> jax.Array:  # f32[T, O]
    """pallas_kernels.lora.lora_delta's "tpu" implementation."""
    num_tokens, num_slots, rank = x.shape[0], a.shape[0], a.shape[2]
    tile = _row_tile(num_tokens)
    padded = -(-num_tokens // tile) * tile
    order, group_sizes = sort_by_slot(token_slots, num_slots)
    rows = jnp.pad(x[order].astype(a.dtype), ((0, padded - num_tokens), (0, 0)))
    shrunk = gmm(rows, a, group_sizes, preferred_element_type=jnp.float32,
                 tiling=(tile, min(K_TILE, a.shape[1]), rank), interpret=interpret)
    out = gmm(shrunk.astype(b.dtype), b, group_sizes, preferred_element_type=jnp.float32,
              tiling=(tile, rank, min(N_TILE, b.shape[2])), interpret=interpret)
    out = out[:num_tokens][jnp.argsort(order)]
    return jnp.where((token_slots >= 0)[:, None], out, 0.0)
