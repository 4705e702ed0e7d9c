"""The CPU reference's prefill attention: a step whose rows compute whole prompts or long chunks
(pallas_kernels.reference picks it), tiled as a flash attention is, in pure jnp.

Queries go `tile` at a time. A tile attends, under one online softmax in f32, to
- the cached context of each sequence it holds (the tokens before this step, read from the
  pages a few blocks at a time: KV_TOKENS_PER_ITER keys shared by the whole tile, not gathered
  once a query token as the paged path does), then
- the step's own rows, `tile` rows a chunk, from the chunk holding its earliest sequence's first
  row of this step through its own (causal within a sequence).
So the work follows the tokens each tile's sequences hold, not the table's capacity or T x
context. Keys past a sequence's context are zeroed before they are read (NaN pages cannot
reach the output); sliding windows, soft caps, sinks, int8 and latent caches as the paged path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pagedjax.pallas_kernels.kv_rows import load_blocks, load_rows


def prefill_attention(
    q: jax.Array,  # [T, N, H]
    kv_cache: jax.Array,  # [2, K, NB, S, H], this step's K/V already written
    seq_ids: jax.Array,  # i32[T]
    q_positions: jax.Array,  # i32[T]: each token's position in its sequence
    q_offsets: jax.Array,  # i32[T]: each token's index among its sequence's rows of this step
    valid: jax.Array,  # bool[T]: a real token (padding attends to nothing)
    context_lens: jax.Array,  # i32[B]: each sequence's tokens cached before this step
    block_tables: jax.Array,  # i32[B, P]
    *, tile: int, kv_tokens_per_iter: int, scale: float, sliding_window: int | None,
    soft_cap: float | None, sinks: jax.Array | None = None, value_dim: int | None = None,
) -> jax.Array:  # [T, N, H] ([T, N, value_dim]: a latent cache)
    num_tokens, num_heads, head_dim = q.shape
    block_size = kv_cache.shape[3]
    blocks = jnp.asarray(block_tables)[seq_ids, jnp.maximum(q_positions, 0) // block_size]
    live = valid[None, :, None]  # a padding token's row may be any page's (NaN included)
    k = jnp.where(live, load_rows(kv_cache, 0, blocks, q_positions % block_size), 0.0)
    v = k[..., :value_dim] if value_dim is not None else jnp.where(
        live, load_rows(kv_cache, 1, blocks, q_positions % block_size), 0.0)
    num_kv_heads = k.shape[0]
    tile = min(tile, num_tokens)
    pad = -num_tokens % tile
    qg = (q.astype(jnp.float32) * scale).reshape(num_tokens, num_kv_heads,
                                                 num_heads // num_kv_heads, head_dim)
    qg = jnp.pad(qg, ((0, pad), (0, 0), (0, 0), (0, 0))).reshape(-1, tile, *qg.shape[1:])
    rows = [jnp.pad(x, (0, pad)).reshape(-1, tile)
            for x in (seq_ids, q_positions, q_offsets, valid)]
    chunks = (*(jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(x.shape[0], -1, tile, x.shape[-1])
                for x in (k, v)), rows[0], rows[1], rows[3])  # the step's keys, `tile` a chunk
    width = block_tables.shape[1]
    per_iter = max(1, min(width, kv_tokens_per_iter // block_size))
    tables = jnp.pad(jnp.asarray(block_tables), ((0, 0), (0, -width % per_iter)))
    context = (kv_cache, tables, jnp.asarray(context_lens), per_iter, value_dim)
    attend = functools.partial(_tile, chunks, context, tile=tile,
                               sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    out = jax.lax.map(attend, (qg, *rows, jnp.arange(qg.shape[0], dtype=jnp.int32)))
    return out.reshape(-1, num_heads, out.shape[-1])[:num_tokens].astype(q.dtype)


def _online(carry, scores, mask, values, soft_cap):
    """One more set of keys into a tile's running softmax (m, l, acc): scores [t, K, G, S]
    where mask [t, S] holds, values [K, S, H]."""
    m, l, acc = carry
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None, :], scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
    p = jnp.exp(scores - m_safe[..., None])
    kept = jnp.exp(m - m_safe)  # 0 while m is -inf
    return (m_new, l * kept + jnp.sum(p, axis=-1),
            acc * kept[..., None] + jnp.einsum("tKGS,KSH->tKGH", p, values))


def _tile(chunks, context, args, *, tile: int, sliding_window, soft_cap, sinks):
    """One tile of queries: its sequences' cached context, then the step's rows (module doc)."""
    k, v, seq_c, pos_c, valid_c = chunks
    qt, seq_t, pos_t, off_t, valid_t, index = args
    num_kv_heads, group = qt.shape[1], qt.shape[2]
    update = functools.partial(_online, soft_cap=soft_cap)

    def step_chunk(j, carry):
        mask = ((seq_c[j][None, :] == seq_t[:, None]) & (pos_c[j][None, :] <= pos_t[:, None])
                & valid_c[j][None, :] & valid_t[:, None])  # [tile, tile]
        if sliding_window is not None:
            mask &= pos_c[j][None, :] > pos_t[:, None] - sliding_window
        return update(carry, jnp.einsum("tKGH,KSH->tKGS", qt, k[:, j]), mask, v[:, j])

    shape = (tile, num_kv_heads, group)
    carry = (jnp.full(shape, -jnp.inf), jnp.zeros(shape), jnp.zeros((*shape, v.shape[-1])))
    carry = _context(context, qt, seq_t, pos_t, valid_t, carry, update, sliding_window)
    starts = index * tile + jnp.arange(tile, dtype=jnp.int32) - off_t  # each query's row 0
    first = jnp.min(jnp.where(valid_t, starts, index * tile)) // tile
    m, l, acc = jax.lax.fori_loop(first, index + 1, step_chunk, carry)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(num_kv_heads, group)
        m_all = jnp.maximum(m, sink)
        acc, l = acc * jnp.exp(m - m_all)[..., None], l * jnp.exp(m - m_all) + jnp.exp(
            sink - m_all)
    return jnp.where(l[..., None] > 0, acc / jnp.where(l > 0, l, 1.0)[..., None], 0.0)


def _context(context, qt, seq_t, pos_t, valid_t, carry, update, sliding_window):
    """The tile's queries against their sequences' tokens cached before this step: each
    sequence of the tile in turn, per_iter blocks of its table at a time."""
    kv_cache, tables, context_lens, per_iter, value_dim = context
    block_size = kv_cache.shape[3]
    keys = per_iter * block_size
    offsets = jnp.arange(keys, dtype=jnp.int32)

    def one_sequence(s, carry):
        cached = context_lens[s]

        def one_chunk(c, carry):
            blocks = jax.lax.dynamic_slice_in_dim(tables[s], c * per_iter, per_iter)
            kv_pos = c * keys + offsets
            inside = (kv_pos < cached)[None, :, None]
            kc = jnp.where(inside, load_blocks(kv_cache, 0, blocks).reshape(
                -1, keys, qt.shape[-1]), 0.0)  # f32[K, C*S, H]
            vc = kc[..., :value_dim] if value_dim is not None else jnp.where(
                inside, load_blocks(kv_cache, 1, blocks).reshape(kc.shape), 0.0)
            mask = ((seq_t[:, None] == s) & valid_t[:, None]
                    & (kv_pos[None, :] < cached))  # [tile, C*S]
            if sliding_window is not None:
                mask &= kv_pos[None, :] > pos_t[:, None] - sliding_window
            return update(carry, jnp.einsum("tKGH,KSH->tKGS", qt, kc), mask, vc)

        return jax.lax.fori_loop(0, (cached + keys - 1) // keys, one_chunk, carry)

    lowest = jnp.min(jnp.where(valid_t, seq_t, context_lens.shape[0]))
    highest = jnp.max(jnp.where(valid_t, seq_t, -1))
    return jax.lax.fori_loop(lowest, highest + 1, one_sequence, carry)
