"""What the attention kernels of every backend share: the online softmax step and its finite
mask value, the precision of their dots, the ragged tiling of query tokens, the TPU
interpreter's parameters; and the grouped LoRA kernels' sort of a step's tokens by slot."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: no inf - inf in the softmax


def dot_precision(dtype) -> jax.lax.Precision | None:
    """The precision of the kernels' dots, as XLA picks it for the model's other matmuls.

    Triton takes f32 operands as TF32 (a 10-bit mantissa, ~1e-3 relative) unless asked for
    IEEE f32, and so does XLA on a GPU under JAX's default matmul precision. With
    `jax.default_matmul_precision("highest")` (or "float32") an f32 cache gets IEEE f32 products,
    as XLA's f32 matmuls then do; they cost registers (about 255 a thread, spilling) where TF32
    does not. 16-bit and quantized caches multiply 16-bit operands either way."""
    if jnp.dtype(dtype) != jnp.float32:
        return None
    setting = jax.config.jax_default_matmul_precision  # type: ignore[attr-defined]  # a jax.config flag (untyped)
    if setting in ("highest", "float32", "F32_F32_F32", jax.lax.Precision.HIGHEST):
        return jax.lax.Precision.HIGHEST
    return None


def online_softmax_step(q, k, v, visible, carry, *, scale: float, soft_cap: float | None,
                        k_scales=None, v_scales=None, rope=None):
    """One flash-attention update of the carry (o [R, H], m, l) with a block of keys, shared by
    the Triton and TPU kernels: q [R, H], k and v [T, H] in the dots' operand type, V zeroed
    where it may hold garbage (garbage in K only reaches scores that `visible` masks), visible
    broadcastable to [R, T], scores and accumulators in f32. m and l are [R] (Triton) or [R, 1]
    columns (TPU: Mosaic's vectors are 2-D), and stay so. Masked scores take a finite MASK_VALUE
    and a zero weight, so no inf - inf and no NaN can arise. For a quantized cache read
    unscaled (TPU), the per-key scales [1, T] (zeroed where not visible) multiply the scores
    and the probabilities: q.(s k) = s (q.k). rope: (q_pe [R, Hr], k_pe [T, Hr]), a second
    dot added to the scores (a latent cache's RoPE part, read as its own tile: gpu/triton/
    latent.py)."""
    o, m, l = carry
    columns = m.ndim == 2

    def per_row(x):  # m- or l-shaped -> broadcastable against [R, T] and [R, H]
        return x if columns else x[:, None]

    precision = dot_precision(k.dtype)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32)
    if rope is not None:
        s = s + jax.lax.dot_general(rope[0], rope[1], (((1,), (1,)), ((), ())),
                                    precision=precision, preferred_element_type=jnp.float32)
    s = s * scale
    if k_scales is not None:
        s = s * k_scales
    if soft_cap is not None:
        s = soft_cap * jnp.tanh(s / soft_cap)
    s = jnp.where(visible, s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=columns))
    correction = jnp.exp(m - m_new)
    p = jnp.where(visible, jnp.exp(s - per_row(m_new)), 0.0)
    l = l * correction + jnp.sum(p, axis=1, keepdims=columns)
    if v_scales is not None:
        p = p * v_scales
    o = o * per_row(correction) + jnp.dot(p.astype(v.dtype), v, precision=precision,
                                          preferred_element_type=jnp.float32)
    return o, m_new, l


def tpu_interpret_params(interpret: bool):
    """The TPU interpreter (DMAs and semaphores simulated; out-of-bounds reads raise)."""
    return pltpu.InterpretParams(out_of_bounds_reads="raise") if interpret else False


def tile_layout(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int, tile_q: int):
    """Cuts each sequence's tokens into tiles of tile_q, starting at its first token.

    Returns (tile_seq i32[NT] with -1 for spare tiles, tile_start i32[NT], and for each token its
    tile and row: token_tile i32[T], token_row i32[T]); NT = cdiv(T, tile_q) + B.
    """
    num_rows = cu_q_lens.shape[0] - 1
    num_tiles = pl.cdiv(num_tokens, tile_q) + num_rows
    q_lens = jnp.where(jnp.arange(num_rows) < num_seqs, cu_q_lens[1:] - cu_q_lens[:-1], 0)
    tiles_per_seq = (q_lens + tile_q - 1) // tile_q
    cu_tiles = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(tiles_per_seq)])
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_tiles[1:], t, side="right").astype(jnp.int32)
    live = t < cu_tiles[-1]
    seq_c = jnp.minimum(seq, num_rows - 1)
    tile_start = cu_q_lens[seq_c] + (t - cu_tiles[seq_c]) * tile_q
    tile_seq = jnp.where(live, seq_c, -1)
    tile_start = jnp.where(live, tile_start, 0)
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    token_seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], tokens, side="right"), num_rows - 1)
    local = tokens - cu_q_lens[token_seq]
    token_tile = jnp.minimum(cu_tiles[token_seq] + local // tile_q, num_tiles - 1)
    return tile_seq, tile_start.astype(jnp.int32), token_tile, local % tile_q


def sort_by_slot(token_slots: jax.Array, num_slots: int):
    """(order i32[T]: the tokens by slot, base tokens last; group_sizes i32[S]: each slot's
    tokens) for the grouped kernels; x[order] is grouped, out[argsort(order)] back."""
    keys = jnp.where(token_slots < 0, num_slots, token_slots)
    order = jnp.argsort(keys, stable=True).astype(jnp.int32)
    group_sizes = jnp.sum(jax.nn.one_hot(keys, num_slots, dtype=jnp.int32), axis=0)
    return order, group_sizes


def sink_rows(sinks, num_kv_heads: int, group: int, padded_group: int):
    """f32[K, Gp]: attention sinks f32[N] by KV head and row of its query-head group, a padded
    row's MASK_VALUE (it sees nothing); None without sinks."""
    if sinks is None:
        return None
    per_head = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    return jnp.pad(per_head, ((0, 0), (0, padded_group - group)), constant_values=MASK_VALUE)
