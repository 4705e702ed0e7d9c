"""Paged attention in pure jnp: the reference every kernel is tested against, and the CPU path.

Axis letters: T query tokens, B sequences, P blocks per sequence, S block size, N query heads,
K KV heads, G = N // K query heads per KV head, H head dim, NB physical blocks.

The loop runs over logical blocks up to the longest live context, a few blocks per iteration
(C = KV_TOKENS_PER_ITER // S), reading each sequence's blocks through its block table, with an
online softmax in f32. Attention sinks (gpt-oss): one learned logit a query head, f32[N], that
joins every softmax's denominator and carries no value. A latent cache (multi-head latent
attention, value_dim set: pallas_kernels.layout) has one plane whose first value_dim values are
the value. It never touches blocks past a sequence's kv_len, so NaN in unused pages
cannot reach the output, and its cost follows the attended tokens, not the size of the pool or
the table width. That loop reads each query token's pages for it alone; a step of whole prompts
and long chunks goes through pallas_kernels.reference_prefill instead (query tiles sharing
each key read, as a flash attention's).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.pallas_kernels.kv_rows import load_blocks
from pagedjax.pallas_kernels.reference_prefill import prefill_attention

# Keys read per loop iteration: a few blocks at a time, so the loop count (and its per-iteration
# overhead) stays small while the working set stays bounded whatever the context length.
KV_TOKENS_PER_ITER = 128
# A ragged step of at least FRESH_MIN_TOKENS tokens whose rows with earlier context each compute
# at least PREFILL_MIN_CHUNK tokens (whole prompts, prefill chunks) goes FRESH_TILE queries at a
# time (reference_prefill.prefill_attention); smaller steps and steps with decode-like rows read
# the pages a token at a time.
FRESH_MIN_TOKENS = 64
FRESH_TILE = 128
PREFILL_MIN_CHUNK = 16


def _attend_blocks(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, H]
    seq_ids: jax.Array,  # i32[T] the sequence each query token belongs to
    q_positions: jax.Array,  # i32[T] absolute position of each query token
    token_kv_lens: jax.Array,  # i32[T] kv_len of the token's sequence; 0 masks the token out
    block_tables: jax.Array,  # i32[B, P]
    *, scale: float, sliding_window: int | None, soft_cap: float | None,
    sinks: jax.Array | None = None, kv_tokens_per_iter: int = KV_TOKENS_PER_ITER,
    value_dim: int | None = None,
) -> jax.Array:  # [T, N, H], or [T, N, value_dim]
    num_tokens, num_heads, head_dim = q.shape
    out_dim = head_dim if value_dim is None else value_dim
    _, num_kv_heads, _, block_size, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    # C blocks per iteration; the table is padded with the null block to a multiple of C.
    width = block_tables.shape[1]
    per_iter = max(1, min(width, kv_tokens_per_iter // block_size))
    padded_width = -(-width // per_iter) * per_iter
    block_tables = jnp.pad(jnp.asarray(block_tables), ((0, 0), (0, padded_width - width)))
    num_blocks = (jnp.max(token_kv_lens) + block_size - 1) // block_size
    num_iters = (num_blocks + per_iter - 1) // per_iter
    offsets = jnp.arange(per_iter * block_size, dtype=jnp.int32)

    def body(j, carry):
        m, l, acc = carry
        cols = j * per_iter + jnp.arange(per_iter, dtype=jnp.int32)
        blocks = block_tables[seq_ids[:, None], cols[None, :]]  # i32[T, C]
        k_shape = (num_kv_heads, num_tokens, per_iter * block_size, head_dim)
        k = load_blocks(kv_cache, 0, blocks).reshape(k_shape)  # f32[K, T, C*S, H]
        v = (load_blocks(kv_cache, 1, blocks).reshape(k_shape) if value_dim is None
             else k[..., :value_dim])
        kv_pos = j * per_iter * block_size + offsets  # i32[C*S]
        mask = (kv_pos[None, :] <= q_positions[:, None]) & (
            kv_pos[None, :] < token_kv_lens[:, None])  # [T, S]
        if sliding_window is not None:
            mask &= kv_pos[None, :] > q_positions[:, None] - sliding_window
        s = jnp.einsum("TKGH,KTSH->TKGS", qg, jnp.where(mask[None, :, :, None], k, 0.0))
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
        p = jnp.exp(s - m_safe[..., None])  # exactly 0 where masked
        alpha = jnp.exp(m - m_safe)
        v = jnp.where(mask[None, :, :, None], v, 0.0)
        acc = acc * alpha[..., None] + jnp.einsum("TKGS,KTSH->TKGH", p, v)
        return m_new, l * alpha + jnp.sum(p, axis=-1), acc

    stats = (num_tokens, num_kv_heads, group)
    if sinks is None:
        m0, l0 = jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32)
    else:  # one more logit a head in every softmax, with no value: the running max starts
        # at it and the denominator at exp(sink - sink) = 1
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(num_kv_heads, group), stats)
        l0 = jnp.ones(stats, jnp.float32)
    init = (m0, l0,
            jnp.zeros((num_tokens, num_kv_heads, group, out_dim), jnp.float32))
    _, l, acc = jax.lax.fori_loop(0, num_iters, body, init)
    out = jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)
    return out.reshape(num_tokens, num_heads, out_dim).astype(q.dtype)


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, H], this step's K/V already written
    kv_lens: jax.Array,  # i32[B] context length of each sequence after this step
    block_tables: jax.Array,  # i32[B, P]
    cu_q_lens: jax.Array,  # i32[B + 1] start of each sequence's query tokens
    num_seqs: jax.Array,  # i32[] only the first num_seqs rows are valid
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, value_dim: int | None = None,
) -> jax.Array:  # [T, N, H] ([T, N, value_dim]: a latent cache); 0 for padding tokens
    """Each sequence's query tokens are the last q_len of its kv_len tokens: causal within the
    chunk, full attention to the cached prefix."""
    num_tokens = q.shape[0]
    num_rows = block_tables.shape[0]
    kv_lens, cu_q_lens = jnp.asarray(kv_lens), jnp.asarray(cu_q_lens)
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq_ids = jnp.searchsorted(cu_q_lens[1:], t, side="right").astype(jnp.int32)
    valid = (seq_ids < num_seqs) & (t < cu_q_lens[num_seqs])
    seq_ids = jnp.minimum(seq_ids, num_rows - 1)
    q_positions = kv_lens[seq_ids] - (cu_q_lens[seq_ids + 1] - t)
    token_kv_lens = jnp.where(valid, kv_lens[seq_ids], 0)
    options: dict[str, Any] = dict(scale=scale, sliding_window=sliding_window,
                                   soft_cap=soft_cap, sinks=sinks, value_dim=value_dim)
    paged = functools.partial(_attend_blocks, q, kv_cache, seq_ids, q_positions,
                              token_kv_lens, block_tables, **options)
    if num_tokens < FRESH_MIN_TOKENS:
        return paged()
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    context_lens = jnp.where(rows < num_seqs, kv_lens - q_lens, 0)
    # every row computes a whole prompt or a long chunk: no decode-like row a tile would serve
    # alone (the paged path's per-token reads suit those)
    tiled = jnp.all((context_lens == 0) | (q_lens >= PREFILL_MIN_CHUNK))
    return jax.lax.cond(tiled, lambda: prefill_attention(
        q, kv_cache, seq_ids, q_positions, t - cu_q_lens[seq_ids], valid, context_lens,
        block_tables, tile=FRESH_TILE, kv_tokens_per_iter=KV_TOKENS_PER_ITER, **options),
        paged)


def paged_decode_attention_reference(
    q: jax.Array,  # [B, N, H] one query token per sequence
    kv_cache: jax.Array,  # [2, K, NB, S, H], this step's K/V already written
    kv_lens: jax.Array,  # i32[B]
    block_tables: jax.Array,  # i32[B, P]
    num_seqs: jax.Array,  # i32[] only the first num_seqs rows are valid
    *, scale: float, sliding_window: int | None = None, soft_cap: float | None = None,
    sinks: jax.Array | None = None, value_dim: int | None = None,
) -> jax.Array:  # [B, N, H] ([B, N, value_dim]: a latent cache); 0 for padding rows
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    kv_lens = jnp.asarray(kv_lens)
    token_kv_lens = jnp.where(rows < num_seqs, kv_lens, 0)
    return _attend_blocks(q, kv_cache, rows, kv_lens - 1, token_kv_lens, block_tables,
                          scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                          sinks=sinks, value_dim=value_dim)
