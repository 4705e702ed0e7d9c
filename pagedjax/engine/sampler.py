"""Sampling on device: only the sampled ids leave the step, never the [B, V] logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _filter_min_p(
    logits: jax.Array,  # f32[B, V], already divided by temperature
    min_p: jax.Array,  # f32[B] 0 disables
) -> jax.Array:  # f32[B, V] with filtered entries at -inf
    """vLLM's min-p: a token whose probability is below min_p x the most likely token's is
    dropped. p_i / p_max = exp(l_i - l_max), so the test needs no softmax."""
    threshold = jnp.max(logits, axis=-1, keepdims=True) + jnp.log(min_p)[:, None]  # -inf at 0
    return jnp.where(logits < threshold, -jnp.inf, logits)


def _filter_top_k_top_p(
    logits: jax.Array,  # f32[B, V], already divided by temperature
    top_k: jax.Array,  # i32[B] -1 disables
    top_p: jax.Array,  # f32[B] 1 disables
) -> jax.Array:  # f32[B, V] with filtered entries at -inf
    vocab = logits.shape[-1]
    sorted_desc = -jnp.sort(-logits, axis=-1)
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranks = jnp.arange(vocab)[None, :]
    sorted_desc = jnp.where(ranks < k[:, None], sorted_desc, -jnp.inf)
    probs = jax.nn.softmax(sorted_desc, axis=-1)
    # Keep the smallest prefix whose mass reaches top_p (always at least one token).
    keep = (jnp.cumsum(probs, axis=-1) - probs) < top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep & (ranks < k[:, None]), axis=-1), 1)
    threshold = jnp.take_along_axis(sorted_desc, (num_keep - 1)[:, None], axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


def sample(
    logits: jax.Array,  # f32[B, V]
    temperature: jax.Array,  # f32[B] 0 means greedy
    top_k: jax.Array,  # i32[B]
    top_p: jax.Array,  # f32[B]
    seeds: jax.Array,  # u32[B]
    positions: jax.Array,  # i32[B] position of the token being sampled
    num_top_logprobs: int = 0,  # static: K most likely tokens returned per row
    min_p: jax.Array | None = None,  # f32[B] 0 disables; None: none of the rows uses it
    logit_bias: tuple[jax.Array, jax.Array] | None = None,  # (ids i32[B, L], biases f32[B, L])
) -> tuple[jax.Array, ...]:
    """Greedy rows take the argmax; the others sample with key fold_in(key(seed), position), so a
    request's tokens depend only on its seed and its context, not on its batch neighbours.

    logit_bias is added to the logits every row samples from, greedy ones too (OpenAI's); unused
    slots add 0 to token 0.

    Returns ids i32[B], their logprobs f32[B] under the model (raw logits, before the bias,
    temperature and filtering), and the K most likely tokens of each row: i32[B, K], f32[B, K].
    """
    def pick(lg):
        return _sample_ids(lg, temperature, top_k, top_p, seeds, positions, min_p)

    if logit_bias is None:
        ids = pick(logits)
    else:  # a step where no row biases runs the sampler on the logits as they are
        bias_ids, bias_values = logit_bias
        rows = jnp.arange(logits.shape[0])[:, None]
        ids = jax.lax.cond(
            jnp.any(bias_values != 0),
            lambda lg: pick(lg.at[rows, bias_ids].add(bias_values.astype(lg.dtype))),
            pick, logits)
    log_probs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(log_probs, ids[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(log_probs, num_top_logprobs)
    return ids, chosen, top_ids.astype(jnp.int32), top_logprobs


def _sample_ids(logits, temperature, top_k, top_p, seeds, positions, min_p) -> jax.Array:
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
        if min_p is not None:  # before top-k / top-p, in vLLM's order
            scaled = _filter_min_p(scaled, min_p)
        filtered = _filter_top_k_top_p(scaled, top_k, top_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
        ids = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, ids, greedy_ids)

    return jax.lax.cond(jnp.all(temperature == 0), lambda _: greedy_ids, sampled, None)
