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


def apply_token_mask(
    logits: jax.Array,  # f32[B, V]
    token_mask: jax.Array,  # i32[B, W] bit j of word w: token 32 w + j may be sampled
) -> jax.Array:  # f32[B, V] with masked-out tokens at -inf
    """The bitmask of allowed_token_ids, bad_words, min_tokens and grammars (llguidance's
    layout: W = ceil(V / 32) words a row, little-endian bits)."""
    vocab = logits.shape[-1]
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)


def apply_penalties(
    logits: jax.Array,  # f32[B, V]
    tokens: jax.Array,  # i32[B, H] each row's prompt then output tokens; -1 pads
    prompt_lens: jax.Array,  # i32[B] how many of a row's tokens are its prompt's
    presence: jax.Array,  # f32[B] 0 disables
    frequency: jax.Array,  # f32[B] 0 disables
    repetition: jax.Array,  # f32[B] 1 disables
) -> jax.Array:
    """vLLM's penalties: repetition over the tokens of prompt and output (a seen token's logit
    is divided by the penalty when positive, multiplied when not); frequency times each output
    token's count and presence once for each output token that occurred are subtracted. The
    counts are rebuilt from the tokens each step (a scatter into [B, V])."""
    batch, vocab = logits.shape
    rows = jnp.arange(batch)[:, None]
    valid = tokens >= 0
    ids = jnp.where(valid, tokens, vocab)  # out of range: dropped by the scatters
    is_output = valid & (jnp.arange(tokens.shape[1])[None, :] >= prompt_lens[:, None])
    counts = jnp.zeros((batch, vocab), jnp.float32).at[rows, ids].add(
        is_output.astype(jnp.float32), mode="drop")
    seen = jnp.zeros((batch, vocab), bool).at[rows, ids].set(True, mode="drop")
    rep = repetition[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0)


# top-k / top-p look at the TOP_CANDIDATES most likely tokens of each row (lax.top_k) rather
# than sorting the vocabulary; a step with a row whose filter reaches past them (top_k above it,
# or a top-p nucleus their mass does not close) sorts. SmolLM2's own logits (49,152 tokens) on
# this CPU, top_k 50 / top_p 0.95: the sampler at batch 8 took 75 ms sorting, against a 52 ms
# forward, and takes 7.5 ms (benchmarks/sampler_topk.py: 8.7-10x at batch 8 and 32).
TOP_CANDIDATES = 256


def _filter_top_k_top_p(
    logits: jax.Array,  # f32[B, V], already divided by temperature
    top_k: jax.Array,  # i32[B] -1 disables
    top_p: jax.Array,  # f32[B] 1 disables
) -> jax.Array:  # f32[B, V] with filtered entries at -inf
    """vLLM's top-k then top-p (the nucleus of the top-k renormalised): a token is dropped
    when its logit is below the last kept one's. A row with neither filter keeps every token."""
    vocab = logits.shape[-1]
    cap = min(TOP_CANDIDATES, vocab)
    if cap == vocab:
        return _filter_sorted(logits, top_k, top_p)
    values = jax.lax.top_k(logits, cap)[0]  # [B, cap], descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    ranks = jnp.arange(cap)[None, :]
    within = jnp.where(ranks < k[:, None], values, -jnp.inf)
    # the softmax over the k kept: the candidates' when k <= cap, else the whole row's
    norm = jnp.where(k <= cap, jax.nn.logsumexp(within, axis=-1),
                     jax.nn.logsumexp(logits, axis=-1))
    probs = jnp.exp(within - norm[:, None])
    mass = jnp.cumsum(probs, axis=-1)
    keep = (mass - probs) < top_p[:, None]
    num_keep = jnp.maximum(jnp.sum(keep & (ranks < k[:, None]), axis=-1), 1)
    unfiltered = (k == vocab) & (top_p >= 1.0)
    threshold = jnp.where(unfiltered, -jnp.inf,
                          jnp.take_along_axis(within, (num_keep - 1)[:, None], axis=-1)[:, 0])
    # the kept tokens lie among the candidates: k within them, or (no top_k: the whole row
    # normalises) the nucleus closed in them; a top_k past them normalises over more: sorted
    closed = unfiltered | (k <= cap) | ((k == vocab) & (mass[:, -1] >= top_p))
    return jax.lax.cond(
        jnp.all(closed), lambda x: jnp.where(x < threshold[:, None], -jnp.inf, x),
        lambda x: _filter_sorted(x, top_k, top_p), logits)


def _filter_sorted(logits, top_k, top_p) -> jax.Array:
    """_filter_top_k_top_p over the whole row sorted."""
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


def sample(logits, temperature, top_k, top_p, seeds, positions, num_top_logprobs: int = 0,
           **options) -> tuple[jax.Array, ...]:
    """ids i32[B], their logprobs f32[B] and the K most likely tokens of each row (i32[B, K],
    f32[B, K]): sample_values' ids, and its values' top (options: sample_values' keywords)."""
    ids, values = sample_values(logits, temperature, top_k, top_p, seeds, positions, **options)
    return (ids, *top_values(ids, values, num_top_logprobs))


def sample_values(
    logits: jax.Array,  # f32[B, V]
    temperature: jax.Array,  # f32[B] 0 means greedy
    top_k: jax.Array,  # i32[B]
    top_p: jax.Array,  # f32[B]
    seeds: jax.Array,  # u32[B]
    positions: jax.Array,  # i32[B] position of the token being sampled
    min_p: jax.Array | None = None,  # f32[B] 0 disables; None: none of the rows uses it
    logit_bias: tuple[jax.Array, jax.Array] | None = None,  # (ids i32[B, L], biases f32[B, L])
    penalties: tuple[jax.Array, ...] | None = None,  # apply_penalties' arguments after logits
    token_mask: jax.Array | None = None,  # i32[B, W] (apply_token_mask)
    logprobs_mode: str = "raw_logprobs",  # static: what the logprobs are (logprob_values)
) -> tuple[jax.Array, ...]:
    """Greedy rows take the argmax; the others sample with key fold_in(key(seed), position), so a
    request's tokens depend only on its seed and its context, not on its batch neighbours.

    What every row samples from, greedy ones too, in vLLM's order: the token mask, logit_bias
    (OpenAI's; unused slots add 0 to token 0), the penalties; then temperature, min-p, top-k and
    top-p for the sampled rows. penalties and token_mask are None when no row of the step uses
    them (the program has none of their work).

    Returns ids i32[B] and what a request's logprobs report, f32[B, V] (logprobs_mode; the
    default: log-softmax under the model, raw logits before the bias, temperature and
    filtering).
    """
    processed = logits if token_mask is None else apply_token_mask(logits, token_mask)
    if logit_bias is not None:  # a step where no row biases leaves the logits as they are
        bias_ids, bias_values = logit_bias
        rows = jnp.arange(logits.shape[0])[:, None]
        processed = jax.lax.cond(
            jnp.any(bias_values != 0),
            lambda lg: lg.at[rows, bias_ids].add(bias_values.astype(lg.dtype)),
            lambda lg: lg, processed)
    if penalties is not None:
        processed = apply_penalties(processed, *penalties)
    ids = _sample_ids(processed, temperature, top_k, top_p, seeds, positions, min_p)
    values = logprob_values(logits, processed, temperature, top_k, top_p, min_p, logprobs_mode)
    return ids, values


def token_ranks(values: jax.Array, chosen: jax.Array) -> jax.Array:
    """i32[B]: each row's rank of its token's value chosen[b] among values[b] as vLLM counts it
    (vllm/v1/sample/ops/logprobs.py: the values at or above it, itself included: ties rank
    the token after the others)."""
    return jnp.sum(values >= chosen[:, None], axis=-1, dtype=jnp.int32)


def top_values(ids: jax.Array, values: jax.Array, num_top: int) -> tuple[jax.Array, ...]:
    """(the sampled tokens' values f32[B], the num_top largest values' ids i32[B, K] and values
    f32[B, K]) of a row's values (logprob_values)."""
    chosen = jnp.take_along_axis(values, ids[:, None], axis=-1)[:, 0]
    top, top_ids = jax.lax.top_k(values, num_top)
    return chosen, top_ids.astype(jnp.int32), top


def logprob_values(logits, processed, temperature, top_k, top_p, min_p,
                   mode: str) -> jax.Array:
    """f32[B, V]: what a request's logprobs report, by logprobs_mode (vLLM's): raw_logprobs,
    the model's log-softmax before any processing (a trainer's); raw_logits; processed_logits,
    what the row draws from (token mask, logit_bias, penalties, then temperature (a greedy row's
    1), min-p, top-k, top-p: filtered tokens at -inf); processed_logprobs, their log-softmax."""
    if mode == "raw_logprobs":
        return jax.nn.log_softmax(logits, axis=-1)
    if mode == "raw_logits":
        return logits
    scored = filtered_logits(processed, temperature, top_k, top_p, min_p)
    return scored if mode == "processed_logits" else jax.nn.log_softmax(scored, axis=-1)


def filtered_logits(logits, temperature, top_k, top_p, min_p) -> jax.Array:
    """f32[B, V]: what a sampled row draws from, as logits: divided by the temperature (a
    greedy row's by 1), then min-p, top-k and top-p in vLLM's order, filtered ones at -inf."""
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    if min_p is not None:  # before top-k / top-p, in vLLM's order
        scaled = _filter_min_p(scaled, min_p)
    # The sort top-k / top-p need is most of the sampler's time: a step where no row filters
    # (vLLM's default top_k -1, top_p 1) samples without it.
    return jax.lax.cond(jnp.any((top_k > 0) | (top_p < 1.0)),
                        lambda x: _filter_top_k_top_p(x, top_k, top_p), lambda x: x, scaled)


def _sample_ids(logits, temperature, top_k, top_p, seeds, positions, min_p) -> jax.Array:
    greedy_ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(_):
        filtered = filtered_logits(logits, temperature, top_k, top_p, min_p)
        keys = jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)
        ids = jax.vmap(jax.random.categorical)(keys, filtered).astype(jnp.int32)
        return jnp.where(temperature > 0, ids, greedy_ids)

    return jax.lax.cond(jnp.all(temperature == 0), lambda _: greedy_ids, sampled, None)
