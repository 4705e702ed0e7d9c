"""The rejection sampler of speculative decoding, on device: given the target model's
distributions at a row's k + 1 positions (its k draft tokens and the one after them) it keeps
the longest prefix of drafts the target accepts and adds one token of its own, so that the
tokens come out distributed exactly as plain sampling from the target would make them
(Leviathan et al. 2023; vLLM's RejectionSampler).

Draft j (token d, drafted with probability q(d); q is one-hot for n-gram and prediction drafts)
is accepted with probability min(1, p(d) / q(d)), p the target's processed distribution there.
At the first rejection the row's token is drawn from max(p - q, 0) normalised (the recovered
token); when every draft is accepted, from p at the position after them (the bonus token). A
greedy row's p is one-hot at the target's argmax, so it accepts a draft exactly when the draft
is the argmax and then takes the argmax: plain greedy decoding's tokens.

p must be what plain sampling draws from at that position, every processor applied (token
masks and grammars, logit_bias, penalties, temperature, min-p, top-k, top-p: target_probs).
Randomness: the uniform of draft j and the recovered or bonus draw at position j use keys
folded from the request's seed and that token's position, so a seeded request gives the same
tokens in any batch.

Axis letters: B rows, K drafts a row (padded), V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.engine.sampler import filtered_logits

ACCEPT, DRAW = 0, 1  # the two random streams a position's key is folded with


def target_probs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array,
                 top_p: jax.Array, min_p: jax.Array | None = None) -> jax.Array:
    """f32[R, V]: the distribution plain sampling draws a row's token from, given logits the
    token mask, logit_bias and penalties were already applied to (sampler.sample's order):
    one-hot at the argmax for a greedy row (temperature 0)."""
    probs = jax.nn.softmax(filtered_logits(logits, temperature, top_k, top_p, min_p), axis=-1)
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
    return jnp.where((temperature > 0)[:, None], probs, greedy)


def rejection_sample(
    probs: jax.Array,  # f32[B, K + 1, V] the target's distributions (target_probs)
    drafts: jax.Array,  # i32[B, K] draft tokens (padding past num_drafts: any id)
    num_drafts: jax.Array,  # i32[B] a row's real drafts (0 for a row without)
    seeds: jax.Array,  # u32[B]
    positions: jax.Array,  # i32[B] the position of a row's first draft token
    draft_probs: jax.Array | None = None,  # f32[B, K, V] q; None: each draft one-hot
) -> tuple[jax.Array, jax.Array]:  # (tokens i32[B, K + 1] (-1 past the row's), count i32[B])
    """The row's accepted drafts and then its recovered or bonus token: count = accepted + 1
    tokens, the first count of tokens[b]."""
    batch, k, vocab = drafts.shape[0], drafts.shape[1], probs.shape[-1]
    draft_q = (jax.nn.one_hot(drafts, vocab, dtype=jnp.float32) if draft_probs is None
               else draft_probs)
    keys = jax.vmap(lambda s: jax.random.key(s))(seeds)
    steps = jnp.arange(k + 1, dtype=jnp.int32)

    def row_keys(key, position, stream):
        return jax.vmap(lambda j: jax.random.fold_in(
            jax.random.fold_in(key, position + j), stream))(steps)

    accept_keys = jax.vmap(row_keys, in_axes=(0, 0, None))(keys, positions, ACCEPT)
    draw_keys = jax.vmap(row_keys, in_axes=(0, 0, None))(keys, positions, DRAW)
    uniforms = jax.vmap(jax.vmap(jax.random.uniform))(accept_keys[:, :k])  # f32[B, K]
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_draft = jnp.take_along_axis(draft_q, drafts[..., None], axis=-1)[..., 0]
    ratio = jnp.where(q_draft > 0, p_draft / jnp.where(q_draft > 0, q_draft, 1.0), 0.0)
    accepted = (uniforms < jnp.minimum(ratio, 1.0)) & (steps[None, :k] < num_drafts[:, None])
    count = jnp.sum(jnp.cumprod(accepted.astype(jnp.int32), axis=1), axis=1)  # i32[B]
    # the last token: recovered from max(p - q, 0) at a rejection, else the bonus from p
    rows = jnp.arange(batch)
    p_last = probs[rows, count]
    q_last = jnp.where((count < num_drafts)[:, None],
                       jnp.concatenate([draft_q, jnp.zeros((batch, 1, vocab))], 1)[rows, count],
                       0.0)
    residual = jnp.maximum(p_last - q_last, 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_last)
    last = jax.vmap(jax.random.categorical)(draw_keys[rows, count],
                                            jnp.log(residual)).astype(jnp.int32)
    tokens = jnp.where(steps[None, :k] < count[:, None], drafts, -1)
    tokens = jnp.concatenate([tokens, jnp.full((batch, 1), -1, jnp.int32)], axis=1)
    tokens = tokens.at[rows, count].set(last)
    return tokens, count + 1
