"""The rejection sampler of speculative decoding, on device: given the target model's
distributions at a row's k + 1 positions (its k draft tokens and the one after them) it keeps
the longest prefix of drafts the target accepts and adds one token of its own, so that the
tokens come out distributed exactly as plain sampling from the target would make them
(Leviathan et al. 2023; vLLM's RejectionSampler).

Draft j (token d, drafted with probability q(d)) is accepted with probability
min(1, p(d) / q(d)), p the target's processed distribution there. At the first rejection the
row's token is drawn from max(p - q, 0) normalised (the recovered token); when every draft is
accepted, from p at the position after them (the bonus token).

The engine's proposers draft deterministically (n-gram, a prediction, a greedy draft model):
q is one-hot, and the rule becomes: accept d with probability p(d); on rejection draw from p
without d. `verified_tokens` realises exactly that by coupling: the target samples each
position as plain sampling would (the same key: the request's seed and the token's position,
every processor applied: sampler.sample on the rows expand_rows makes) and a draft is accepted
when that sample equals it. The sample equals d with probability p(d), and, when it does not,
it is distributed as p without d, the recovered token; after k accepted drafts the (k+1)-th
sample is the bonus token. So the tokens are the ones plain decoding gives with the same seed,
bit for bit, in any batch, and a greedy row is the argmax chain. `rejection_sample` is the
general rule for a drafter that samples its drafts (q not one-hot).

p must be what plain sampling draws from at that position, every processor applied (token
masks and grammars, logit_bias, penalties, temperature, min-p, top-k, top-p: target_probs).

Axis letters: B rows, K drafts a row (padded), V vocabulary, H a row's token history.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.engine.sampler import filtered_logits

ACCEPT, DRAW = 0, 1  # the two random streams a position's key is folded with


def expand_rows(inputs: dict, k: int) -> dict:
    """A speculative plan's sampling inputs (SAMPLING_FIELDS, B rows) as B * (k + 1) rows, row
    b * (k + 1) + j verifying row b's draft j (j = num_draft_tokens[b]: the bonus): the row's
    settings repeated, kv_lens the position of the token it samples (plain sampling's key
    there), and its penalty tokens followed by the row's first j drafts (what penalties count
    at that position). Returns plain inputs (no draft columns)."""
    drafts, num_drafts = inputs["draft_token_ids"], inputs["num_draft_tokens"]
    batch = drafts.shape[0]
    flat = {name: jnp.repeat(value, k + 1, axis=0) for name, value in inputs.items()}
    steps = jnp.arange(k + 1, dtype=jnp.int32)
    flat["kv_lens"] = ((inputs["kv_lens"] - num_drafts)[:, None] + steps[None, :]).reshape(-1)
    tokens = inputs["penalty_tokens"]  # i32[B, H]: prompt then output, -1 after
    if tokens.shape[1]:
        offset = (jnp.arange(tokens.shape[1])[None, :]
                  - jnp.sum(tokens >= 0, axis=1)[:, None])[:, None, :]  # [B, 1, H]
        draft_at = jnp.take_along_axis(drafts[:, None, :],
                                       jnp.clip(offset, 0, k - 1).astype(jnp.int32), axis=2)
        flat["penalty_tokens"] = jnp.where(
            (offset >= 0) & (offset < steps[None, :, None]), draft_at,
            tokens[:, None, :]).reshape(batch * (k + 1), -1)
    flat["draft_token_ids"] = jnp.zeros((batch * (k + 1), 0), jnp.int32)
    flat["num_draft_tokens"] = jnp.zeros(batch * (k + 1), jnp.int32)
    return flat


def verified_tokens(
    samples: jax.Array,  # i32[B, K + 1] the target's own sample at each position (expand_rows)
    drafts: jax.Array,  # i32[B, K]
    num_drafts: jax.Array,  # i32[B]
) -> jax.Array:  # i32[B, K + 1]: the row's tokens, -1 after them
    """One-hot drafts verified by coupling (module docstring): the drafts the target's samples
    agree with, up to the first disagreement, then the target's sample there."""
    k = drafts.shape[1]
    agree = (samples[:, :k] == drafts) & (jnp.arange(k)[None, :] < num_drafts[:, None])
    count = 1 + jnp.sum(jnp.cumprod(agree.astype(jnp.int32), axis=1), axis=1)
    return jnp.where(jnp.arange(k + 1)[None, :] < count[:, None], samples, -1)


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
